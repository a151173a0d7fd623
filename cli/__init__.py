"""The ``epd`` command and the launcher: the composition root, standing on the services, the
gateway and the ``epd`` library (which import nothing from here)."""
