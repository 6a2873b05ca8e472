from builder.cli.app import entry

entry()
