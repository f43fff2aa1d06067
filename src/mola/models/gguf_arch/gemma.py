"""(being written)"""

ARCHITECTURES = ()
