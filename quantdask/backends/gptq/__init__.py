"""GPTQ and AWQ through gptqmodel (``backend``): their options (``options``), the families
gptqmodel is trusted on (``families``), per-module mixes and the search's proxy (``mixed``),
checkpoints saved and reloaded as users load them (``saved``), and what gptqmodel changes in a
worker's process, put back (``process``)."""
