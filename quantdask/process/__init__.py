"""A worker process's side of the cluster: its device and the sampler of it (``devices``),
the worker plugins (``runtime``), the cores lent between CPU slots (``cpu_share``), the model
source it keeps between jobs (``model_source``), the start and end of a task on it
(``attempt``), the log lines a running task sends (``live_log``), and the fork server's
preload (``library_noise``, ``fork_server_exit``).

It may import ``sweepfile``, ``backends`` and the shared words; nothing here knows a job's
phases or the driver."""
