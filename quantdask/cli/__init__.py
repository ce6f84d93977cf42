"""The ``quantdask`` command: its parser and commands (``main``), table rendering and the live
terminal dashboard. Every command calls the same library functions a notebook does."""

from quantdask.cli.main import command, main

__all__ = ["command", "main"]
