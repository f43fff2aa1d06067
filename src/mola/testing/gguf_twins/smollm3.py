"""(being written)"""

TWINS = {}
