"""The job's life around the step loop: its start and end (``JobLife``, ``life.py``, composing
``formation.py``, ``initial.py`` and ``barrier.py`` through ``ranks.py``) and the pauses a loop
takes between steps (``pause.py``)."""
