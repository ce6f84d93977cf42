"""The driver's decisions before and between attempts: where a job may run (``placement``,
``phase_memory``, ``model_facts``), what a sweep will cost (``planning``), lengths a model
cannot take (``lengths``), each model's shared reference (``references``), and what to do
after an attempt ends (``policy``, ``retry``, ``health``: pure, with an injected clock).

It may import ``cluster``, ``store``, ``job`` and the layers below; ``run`` imports it."""
