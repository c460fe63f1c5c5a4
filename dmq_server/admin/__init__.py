"""What an operator does: the admin operations written once, the line console, and the
``dmq`` command line.
"""
