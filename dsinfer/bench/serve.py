"""placeholder"""
def add_args(p): pass
