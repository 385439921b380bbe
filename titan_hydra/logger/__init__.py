"""The ``logger`` config group's objects: where a run's numbers and pictures go.

``MetricLogger`` (``metric_logger.py``) fans each logged step out to the backends the group names
(console, ``metrics.jsonl``, TensorBoard, W&B: ``backends.py``); ``wandb_reader.py`` reads an
offline W&B run back; ``images.py`` writes sample pictures as PNG grids. What the numbers are
(throughput, MFU, memory, the run header) is ``titan_hydra.metrics``'.
"""
