"""The kernel library: maps graph nodes to callables the scheduler can place and run."""

from asyncgraph.kernels.base import KernelKind, OpKernel
from asyncgraph.kernels.factory import KernelFactory, device_dispatch_keys
from asyncgraph.kernels.higher_order import register_higher_order
from asyncgraph.kernels.prim import make_list, make_tuple

__all__ = [
    "KernelFactory",
    "KernelKind",
    "OpKernel",
    "device_dispatch_keys",
    "make_list",
    "make_tuple",
    "register_higher_order",
]
