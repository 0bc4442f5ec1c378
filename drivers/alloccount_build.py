"""cffi build of ``calexec.drivers._alloccount``: allocation *counts* for §13.3.

tracemalloc sees how many bytes are live, not how many allocations were made (a buffer
allocated and freed inside a call leaves no trace in a snapshot). This small C module counts
them: it wraps

- Python's three allocator domains (``PyMem_SetAllocator`` for RAW, MEM and OBJ: object
  headers, array shape/stride blocks, lists, ints...), the way tracemalloc installs its own
  hooks, and
- numpy's data-memory handler (``PyDataMem_SetHandler``, NEP 49: every array data buffer),

delegating every call to the allocator that was installed before and adding one to a counter
per ``malloc``/``calloc``/``realloc``. Counters are atomic; frees are not counted. numpy's
handler is per context (a ContextVar): it is installed in the calling thread's context only.
Python's allocations are counted on every thread, or on the installing thread only
(``caller_only``: a function measured alone, which other threads of the process must not
add to).

Run by setuptools (``cffi_modules`` in setup.py) at ``pip install -e .``; needs numpy's headers
at build time (``numpy`` is in the build requirements).
"""

from __future__ import annotations

import numpy
from cffi import FFI

CDEF = """
int alloccount_install(int caller_only);
int alloccount_uninstall(void);
int alloccount_installed(void);
unsigned long long alloccount_python(void);
unsigned long long alloccount_numpy(void);
"""

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL calexec_alloccount_ARRAY_API
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

static PyMemAllocatorEx prev_alloc[3];
static const PyMemAllocatorDomain domains[3] = {PYMEM_DOMAIN_RAW, PYMEM_DOMAIN_MEM,
                                                PYMEM_DOMAIN_OBJ};
static unsigned long long py_count;
static unsigned long long np_count;
static int installed;
static int numpy_ready;
/* with caller_only, Python's allocations are counted on the installing thread only */
static int caller_only;
static unsigned long owner;

static inline void count_python(void) {
    if (!caller_only || PyThread_get_thread_ident() == owner)
        __atomic_add_fetch(&py_count, 1, __ATOMIC_RELAXED);
}
static PyObject *prev_handler;       /* the numpy handler capsule we wrapped (owned ref) */
static PyDataMem_Handler *prev_np;  /* its struct */

static void *py_malloc(void *ctx, size_t size) {
    PyMemAllocatorEx *p = (PyMemAllocatorEx *)ctx;
    count_python();
    return p->malloc(p->ctx, size);
}
static void *py_calloc(void *ctx, size_t nelem, size_t elsize) {
    PyMemAllocatorEx *p = (PyMemAllocatorEx *)ctx;
    count_python();
    return p->calloc(p->ctx, nelem, elsize);
}
static void *py_realloc(void *ctx, void *ptr, size_t size) {
    PyMemAllocatorEx *p = (PyMemAllocatorEx *)ctx;
    count_python();
    return p->realloc(p->ctx, ptr, size);
}
static void py_free(void *ctx, void *ptr) {
    PyMemAllocatorEx *p = (PyMemAllocatorEx *)ctx;
    p->free(p->ctx, ptr);
}

static void *np_malloc(void *ctx, size_t size) {
    PyDataMemAllocator *p = (PyDataMemAllocator *)ctx;
    __atomic_add_fetch(&np_count, 1, __ATOMIC_RELAXED);
    return p->malloc(p->ctx, size);
}
static void *np_calloc(void *ctx, size_t nelem, size_t elsize) {
    PyDataMemAllocator *p = (PyDataMemAllocator *)ctx;
    __atomic_add_fetch(&np_count, 1, __ATOMIC_RELAXED);
    return p->calloc(p->ctx, nelem, elsize);
}
static void *np_realloc(void *ctx, void *ptr, size_t size) {
    PyDataMemAllocator *p = (PyDataMemAllocator *)ctx;
    __atomic_add_fetch(&np_count, 1, __ATOMIC_RELAXED);
    return p->realloc(p->ctx, ptr, size);
}
static void np_free(void *ctx, void *ptr, size_t size) {
    PyDataMemAllocator *p = (PyDataMemAllocator *)ctx;
    p->free(p->ctx, ptr, size);
}

/* numpy keeps the handler capsule of every array it allocates and frees the data through it,
   so this struct must outlive every array allocated while counting: it is static. */
static PyDataMem_Handler counting_handler = {"calexec_alloccount", 1, {NULL, np_malloc,
                                             np_calloc, np_realloc, np_free}};

/* 0: installed; 1: already installed; -1: numpy's C API or handler unavailable
   (a Python exception is set). With the GIL held (see alloccount_install). */
static int install_locked(int only_caller) {
    if (installed)
        return 1;
    if (!numpy_ready) {
        if (PyArray_ImportNumPyAPI() < 0)
            return -1;
        numpy_ready = 1;
    }
    PyObject *current = PyDataMem_GetHandler();
    if (current == NULL)
        return -1;
    PyDataMem_Handler *cur = (PyDataMem_Handler *)PyCapsule_GetPointer(current, "mem_handler");
    if (cur == NULL) {
        Py_DECREF(current);
        return -1;
    }
    if (prev_np != NULL && cur != prev_np) {
        /* arrays counted under the first install free through counting_handler, which must
           keep delegating to the handler it wrapped then */
        Py_DECREF(current);
        PyErr_SetString(PyExc_RuntimeError, "numpy's data-memory handler changed since the "
                        "allocation counter was first installed");
        return -1;
    }
    PyObject *capsule = PyCapsule_New(&counting_handler, "mem_handler", NULL);
    if (capsule == NULL) {
        Py_DECREF(current);
        return -1;
    }
    /* The wrapped handler stays referenced for the life of the process (prev_np must stay
       valid while any array allocated through counting_handler lives). */
    if (prev_handler == NULL)
        prev_handler = current;
    else
        Py_DECREF(current);
    prev_np = cur;
    counting_handler.allocator.ctx = &prev_np->allocator;
    PyObject *old = PyDataMem_SetHandler(capsule);
    Py_DECREF(capsule);
    if (old == NULL)
        return -1;
    Py_DECREF(old);
    for (int i = 0; i < 3; i++) {
        PyMem_GetAllocator(domains[i], &prev_alloc[i]);
        PyMemAllocatorEx hook = {&prev_alloc[i], py_malloc, py_calloc, py_realloc, py_free};
        PyMem_SetAllocator(domains[i], &hook);
    }
    caller_only = only_caller;
    owner = PyThread_get_thread_ident();
    installed = 1;
    return 0;
}

/* Restore the wrapped allocators (memory allocated through the hooks is freed by the same
   underlying allocators). 0: done; 1: was not installed; -1: numpy refused (exception set). */
static int uninstall_locked(void) {
    if (!installed)
        return 1;
    for (int i = 2; i >= 0; i--)
        PyMem_SetAllocator(domains[i], &prev_alloc[i]);
    installed = 0;
    PyObject *old = PyDataMem_SetHandler(prev_handler);
    /* prev_np stays valid: prev_handler is never released (see install). */
    if (old == NULL)
        return -1;
    Py_DECREF(old);
    return 0;
}

/* cffi releases the GIL around calls into this module; the hooks and numpy's API need it. */
int alloccount_install(int only_caller) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = install_locked(only_caller);
    if (rc < 0) {
        PyErr_Print();  /* the reason reaches stderr; the caller raises with the rc */
    }
    PyGILState_Release(gil);
    return rc;
}

int alloccount_uninstall(void) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int rc = uninstall_locked();
    if (rc < 0) {
        PyErr_Print();
    }
    PyGILState_Release(gil);
    return rc;
}

int alloccount_installed(void) { return installed; }
unsigned long long alloccount_python(void) { return __atomic_load_n(&py_count, __ATOMIC_RELAXED); }
unsigned long long alloccount_numpy(void) { return __atomic_load_n(&np_count, __ATOMIC_RELAXED); }
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("calexec.drivers._alloccount", SOURCE,
                      include_dirs=[numpy.get_include()], py_limited_api=False,
                      # the full C API (allocator hooks): not the limited one cffi defaults to
                      define_macros=[("_CFFI_NO_LIMITED_API", None)],
                      extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror",
                                          "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                                          "-Wno-cast-function-type"])

if __name__ == "__main__":  # pragma: no cover - manual build
    ffibuilder.compile(verbose=True)
