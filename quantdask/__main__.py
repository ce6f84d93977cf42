"""``python -m quantdask``: the ``quantdask`` command."""

from quantdask.cli.main import command

if __name__ == "__main__":  # not again in a process that imports it (multiprocessing spawn)
    command()
