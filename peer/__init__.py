"""The training peer and the `peer` command line."""
