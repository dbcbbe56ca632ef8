"""The job's life around the step loop: its start and end (``JobLife``, ``JobOptions``) and the
pauses a loop takes between steps."""
