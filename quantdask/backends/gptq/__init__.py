"""GPTQ and AWQ through gptqmodel (``backend``): the families it is trusted on (``families``),
per-module mixes and the search's proxy (``mixed``), its checkpoints saved and reloaded as users
load them (``saved``), and what it changes in a worker's process, put back (``process``)."""
