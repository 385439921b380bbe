"""``dry_run=simulate``: a run at its configured world size built and stepped on fake tensors in one
CPU process, measured per rank and compared with the closed-form plan (``simulator.simulate``)."""
