"""The composition root: the ``macaron`` command wires adapters into applications."""
