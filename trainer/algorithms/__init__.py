"""The algorithms, each a composition of an ``Algorithm``, the step kernel and (for spans) the
kernel's ``Spans``, behind the ``Front`` the user holds: ``FaultTolerant``, ``HSDP``, ``DiLoCo``
(with its outer step, fragments and pseudo-gradient codec)."""
