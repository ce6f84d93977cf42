"""Two runs compared: what changed in the environment, whether each model's reference is the
same, and for each job matched by model and config, whether its quality, task accuracy, speed
and memory changed, with paired tests and verdicts (``compare``), plus the regression gates of
``quantdask compare --fail-on`` (``verdicts``, ``gates``). Reads run directories; writes none.
"""
