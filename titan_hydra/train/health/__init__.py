"""A run that watches itself: the ``health`` and ``fault_injection`` config groups.

``settings``   the two groups' objects (their schemas are derived from them)
``guard``      non-finite and spiking steps: skip or apply, decided from reduced values
``rollback``   after too many skips in a row: back to the last checkpoint, past the bad data
``stragglers`` per-rank compute / wait time gathered every few steps
``watchdog``   no step progress for too long: stacks to ``<run>/hang/``, non-zero exit
``recheck``    a step's micro-batches run again: gradients that differ bitwise, transient or persistent
``inject``     faults made on purpose (NaN, spike, slow rank, hang, bit flip) to drill all of the above
``monitor``    what the trainer calls: one object wiring the parts above
"""
