"""Building blocks shared by the decoder families: norms, rotary, attention, SwiGLU, the decoder shell.

The blocks know nothing about parallelism. Families compose them and keep the module names
(``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``, ``norm``, ``output``) that
the generic layout plan in ``decoder_family.py`` addresses, with torch's TP styles and the two in
``tp_styles.py``. Nothing here imports the engine (``parallel/``, ``checkpoint/``, ``train/``).
"""
