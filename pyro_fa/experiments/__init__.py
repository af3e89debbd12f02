"""One module per reproduced experiment; each is a ``pyro-fa`` subcommand (see :mod:`pyro_fa.cli`)."""
