"""Imported first by the fork server (launch/local.py): no cyclic collection while the server
imports torch and the program.

Those imports create millions of objects that live as long as every worker forked from the
server; collecting while they load is wasted work (~10% of the import's CPU, as in launch.py).
Each forked worker freezes what it inherited and turns collection back on (``worker_main``), so a
worker's own garbage is collected as usual.
"""

import gc

gc.disable()
