"""VINDEX3 IR: roles, operator declarations, module objects, text printer and parser."""

from .diagnostics import IRSyntaxError, VxcError
from .module import SCHEMA, Layer, Module, Op, Operand, Region, Tensor, Transform
from .operators import OPERATORS, OperatorDecl
from .parser import parse, parse_bytes, parse_file
from .printer import print_module
from .roles import Placement, Role

__all__ = [
    "SCHEMA", "IRSyntaxError", "VxcError", "Layer", "Module", "Op", "Operand", "Region", "Tensor",
    "Transform", "OPERATORS", "OperatorDecl", "parse", "parse_bytes", "parse_file", "print_module", "Placement", "Role",
]
