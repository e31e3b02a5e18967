"""napari-gpu-relion: RELION-style cryo-EM processing on the GPU, in napari and on the command line.

Importing this package is light: no napari, no Qt, no CuPy. Those load only when a widget, the viewer
or the GPU backend is used.
"""

__version__ = "0.1.0"
