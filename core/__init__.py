"""Pure domain of Macaron server: events, hash chain, upcasting, ports, errors, settings.

Nothing here performs I/O, and nothing here imports another project package.
"""
