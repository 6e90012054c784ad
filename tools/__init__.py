"""AttnStore admin and evaluation tools behind the `attnstore` command."""
