"""Backend modules: host (NumPy), opencl (pyopencl), cuda (CuPy); each is imported only when asked for."""
