"""Plain data on the wire: what a test's process sends pytest, encoded so that reading it
runs no code.

A message is JSON. A JSON object is a dict with string keys; every JSON array is
tagged by its first element: ``["L", ...]`` a list, ``["T", ...]`` a tuple,
``["D", k1, v1, ...]`` a dict with other keys, ``["B", base64]`` bytes. Scalars are
``None``, ``bool``, ``int``, ``float`` (NaN and infinities too) and ``str`` (any code
point, lone surrogates included). Nothing else can be encoded, and decoding builds
only these types: no class is looked up, nothing is called, and no two places of a
decoded value share an object, so what is read costs memory in proportion to its size.
(Pickle, which multiprocessing uses, rebuilds any object by calling what the sender
names: a test's process could run code in pytest's.)
"""

from __future__ import annotations

import base64
import json
from typing import Any

_SCALARS = (type(None), bool, int, float, str)


class WireError(ValueError):
    """A value that is not plain data, or bytes that are not a message."""


def is_plain(value: Any) -> bool:
    """Whether ``value`` encodes as itself (exact types: a subclass is not plain)."""
    kind = type(value)
    if kind in _SCALARS or kind is bytes:
        return True
    if kind is list or kind is tuple:
        return all(is_plain(v) for v in value)
    if kind is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def encode(value: Any) -> bytes:
    """``value`` as a message; ``WireError`` for a part that is not plain data."""
    try:
        text = json.dumps(_tag(value), separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise WireError("the value is nested too deeply") from None
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate (surrogateescape) too


def decode(data: bytes) -> Any:
    """The value a message holds; ``WireError`` for bytes that are not one."""
    try:
        return _untag(json.loads(data.decode("utf-8", "surrogatepass")))
    except WireError:
        raise
    except RecursionError:
        raise WireError("the message is nested too deeply") from None
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise WireError(f"not a message ({exc})") from None


def _tag(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        if all(type(k) is str for k in value):
            return {k: _tag(v) for k, v in value.items()}
        out: list[Any] = ["D"]
        for k, v in value.items():
            out += (_tag(k), _tag(v))
        return out
    if kind is list:
        return ["L", *map(_tag, value)]
    if kind is tuple:
        return ["T", *map(_tag, value)]
    if kind is bytes:
        return ["B", base64.b64encode(value).decode("ascii")]
    raise WireError(f"{kind.__module__}.{kind.__qualname__} is not plain data")


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untag(v) for k, v in value.items()}
    if not isinstance(value, list):
        return value
    if not value or not isinstance(value[0], str):
        raise WireError("an array without its tag")
    tag, rest = value[0], value[1:]
    if tag == "L":
        return [_untag(v) for v in rest]
    if tag == "T":
        return tuple(_untag(v) for v in rest)
    if tag == "D":
        if len(rest) % 2:
            raise WireError("a dict with a key and no value")
        keys, values = map(_untag, rest[::2]), map(_untag, rest[1::2])
        try:
            return dict(zip(keys, values, strict=True))
        except TypeError:  # a list as a key
            raise WireError("a dict key that is not hashable") from None
    if tag == "B" and len(rest) == 1 and isinstance(rest[0], str):
        try:
            return base64.b64decode(rest[0], validate=True)
        except ValueError:
            raise WireError("bytes that are not base64") from None
    raise WireError(f"an array tagged {tag[:20]!r}")


def plain(value: Any, where: str, problems: list[str], text: Any = repr) -> Any:
    """``value`` as plain data: itself when it is; numbers, strings, lists, tuples and
    dicts of other types as their plain counterparts (an ``IntEnum`` as its int, a
    ``numpy.float64`` as its float); any other part as ``text(part)`` (its ``repr``),
    noted in ``problems`` (``where`` names the value)."""
    return value if is_plain(value) else _rebuilt(value, where, problems, text)


def _rebuilt(value: Any, where: str, problems: list[str], text: Any) -> Any:
    """``plain``'s copy of a value that is not plain data, part by part."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return bytes(value)
    if value is None:
        return None
    if isinstance(value, dict):
        return {
            _rebuilt(k, f"{where} key", problems, text): _rebuilt(
                v, f"{where}[{k!r}]", problems, text
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        parts = [_rebuilt(v, f"{where}[{n}]", problems, text) for n, v in enumerate(value)]
        return parts if isinstance(value, list) else tuple(parts)
    problems.append(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which pytest's "
        "process takes only as plain data (str, int, float, bool, None, bytes, lists, tuples "
        f"and dicts of them): its {text.__name__}() is"
    )
    try:
        return str(text(value))
    except Exception:  # noqa: BLE001 - a broken __repr__ or __str__
        return f"<{type(value).__name__} object>"
