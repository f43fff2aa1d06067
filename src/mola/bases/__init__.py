"""The control plane of base models, with no HTTP in it: which bases are
declared (record.py: :class:`Base`, its status and transitions), which are
loaded, loaded on demand and unloaded (control.py: :class:`Bases`), and a
request's hold on one (lease.py: :class:`BaseLease`). host_memory.py sizes a
base and gives the heap back after an unload. How a base is started is the
server's (server/startup.py's start_base), handed to :class:`Bases`."""
