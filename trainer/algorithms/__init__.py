"""The algorithms, each a thin composition of the kernel and the job's life: ``FaultTolerant``,
``HSDP``, ``DiLoCo`` (with its outer step, fragments and pseudo-gradient codec)."""
