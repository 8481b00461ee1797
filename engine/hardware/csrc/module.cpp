// tandem's CPU kernels as one Python extension module, tandem.engine.hardware._cpu_kernels (engine/hardware/
// cpu_kernels.py loads it): importing it loads this library, whose static initializers register the tandem_cpu ops
// of int_dot.cpp and decode_attention.cpp with torch's dispatcher. The module itself holds nothing.

#include <Python.h>

static PyModuleDef cpu_kernels_module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                         "tandem's CPU kernels (torch ops under tandem_cpu::)", -1, nullptr};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&cpu_kernels_module); }
