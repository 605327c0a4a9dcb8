"""The command line: ``python -m runtime COMMAND``, one module per sub-command (see ``main``)."""
