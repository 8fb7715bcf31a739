# Enables pytester for the project's own tests (tests/) and nothing else.
pytest_plugins = ["pytester"]
