"""The ground: the step kernel (``StepEngine``), the ``Algorithm`` it drives, ``Spans``, and what
crosses its parts: the attempt's values, the ports, the replica group, options, the step buffer,
the optimizer step, the data cursor, the recent log, registered user state, the data plane's
communicators, requests between replicas, the job's errors. It imports nothing of the trainer
above it; ``trainer/compose.py`` is the composition root."""
