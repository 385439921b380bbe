"""A run that watches itself: the ``health`` and ``fault_injection`` config groups.

(the two groups' settings, from which their schemas are derived, sit below the spec:
``titan_hydra.config.health`` and ``titan_hydra.config.fault_injection``)
``guard``      non-finite and spiking steps: skip or apply, decided from reduced values
``rollback``   after too many skips in a row: back to the last checkpoint, past the bad data
``stragglers`` per-rank compute / wait time gathered every few steps
``watchdog``   no step progress for too long: stacks to ``<run>/hang/``, non-zero exit
``recheck``    a step's micro-batches run again: gradients that differ bitwise, transient or persistent
``inject``     faults made on purpose (NaN, spike, slow rank, hang, bit flip) to drill all of the above
``monitor``    what the trainer calls: one object wiring the parts above
"""
