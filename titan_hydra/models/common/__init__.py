"""Building blocks shared by the decoder families: norms, rotary, attention, SwiGLU, the decoder shell.

Nothing here knows about parallelism. Families compose these blocks and keep the module
names (``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``, ``norm``, ``output``)
that the generic layout plan in ``decoder_family.py`` addresses.
"""
