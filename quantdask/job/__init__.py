"""One attempt of a job on a worker: the list of phases it goes through (``phases``), the
attempt itself with its deadline, faults and log (``job``, ``faults``), what it brings back
(``outcome``) and the artifacts it keeps (``artifacts``).

It may import ``measure`` (each phase's measurement), ``process`` (the worker it runs on),
``sweepfile``, ``backends`` and the shared words; the driver's layers import it. A capability
adds a kind of job only through ``phases.register_streamed_phases``."""
