// The fused ops called from Python without torch's op dispatch: the module flux_layers._C (this library, imported
// by flux_layers/_library.py after torch.ops.load_library) with ag_gemm and gemm_rs, the implementation of
// torch.ops.flux_layers.ag_gemm / gemm_rs (fused_calls.h) with their arguments in the order a decision binds them:
//   ag_gemm(workspace, plan, weight_nn, run_gemm, x_shard_m, weight, bias | None, return_gathered)
//       -> out, or (out, gathered) if return_gathered
//   gemm_rs(workspace, plan, weight_nn, x, weight, bias | None) -> out
// so that flux_layers/ops binds the first ones once (functools.partial) and a call passes its tensors only, and
// returns what ops.ag_gemm / ops.gemm_rs return.
//
// Why: calling a registered op from Python parses every argument against its schema, boxes them onto a stack and
// runs the dispatcher, which cost 8-19 us per call on the GPU machine, as much as all the call's CUDA work
// (docs/experiments.md). A METH_FASTCALL function reads the tensors out of their Python objects and calls the
// implementation directly.
//
// Only the plain case comes here: every tensor argument exactly a torch.Tensor or nn.Parameter, no torch-function or
// dispatch mode active, and no input that autograd would record (the ops have no autograd formula: the layers'
// autograd.Functions call them with grad mode off). Anything else (tensor subclasses, FakeTensor, modes that observe
// or rewrite ops, inputs requiring grad under grad mode) returns NotImplemented, and the caller makes the registered
// op's call instead, which handles it as torch does for any op. The profiler still sees the call
// (RECORD_FUNCTION under the op's name).
//
// Errors: c10::ValueError -> ValueError, WorkspaceFailed / NoGraphTwin (fused_calls.h) -> the Python types
// flux_layers registers once at load (_set_error_types), other errors -> RuntimeError.
//
// Stable ABI (Py_LIMITED_API, as the whole library): the Python API used is the limited one. Two facts of
// libtorch_python are declared here instead of included (its headers need the full Python API): THPVariable_Wrap,
// and the layout of a tensor's Python object (THPVariable: the object header, then the at::Tensor). The module
// checks that layout when it is imported and exports no function if it does not hold (a torch whose layout
// differs): the op calls then stay the only path.
#include <Python.h>
// Python.h first (it may set feature macros); then torch.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fused_calls.h"

// libtorch_python (torch/csrc/autograd/python_variable.h).
PyObject* THPVariable_Wrap(const at::TensorBase& var);
extern PyObject* THPVariableClass;
extern PyObject* ParameterClass;

namespace {

// torch/csrc/autograd/python_variable.h's THPVariable, as far as this module reads it.
struct TensorObject {
  PyObject ob_base;  // PyObject_HEAD
  at::Tensor cdata;
};

// The tensor of an exact torch.Tensor or nn.Parameter object; null for anything else.
const at::Tensor* plain_tensor(PyObject* obj) {
  PyObject* const type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != THPVariableClass && type != ParameterClass) return nullptr;
  return &reinterpret_cast<TensorObject*>(obj)->cdata;
}

// A call's (x, weight, bias or None), its first three arguments, where the direct path takes them.
struct Operands {
  const at::Tensor* x = nullptr;
  const at::Tensor* w = nullptr;
  std::optional<at::Tensor> bias;
};

// False where the call is left to the registered op: an argument that is not a plain tensor, a torch-function or
// dispatch mode active, or an input that autograd would record.
bool plain_operands(PyObject* const* args, Operands& ops) {
  ops.x = plain_tensor(args[0]);
  ops.w = plain_tensor(args[1]);
  const at::Tensor* b = args[2] == Py_None ? nullptr : plain_tensor(args[2]);
  if (ops.x == nullptr || ops.w == nullptr || (args[2] != Py_None && b == nullptr)) return false;
  if (c10::impl::TorchDispatchModeTLS::any_modes_set() || at::impl::torch_function_mode_enabled()) return false;
  if (at::GradMode::is_enabled() &&
      (ops.x->requires_grad() || ops.w->requires_grad() || (b != nullptr && b->requires_grad())))
    return false;
  if (b != nullptr) ops.bias = *b;
  return true;
}

PyObject* not_implemented() {
  Py_INCREF(Py_NotImplemented);
  return Py_NotImplemented;
}

// The Python types of the typed failures (flux_layers/runtime/workspace.py), set once at load; RuntimeError before.
PyObject* g_workspace_error = nullptr;
PyObject* g_no_graph_twin = nullptr;

// Runs fn with the GIL released, translating C++ errors (module comment). Returns false with the Python error set.
template <class Fn>
bool call_released(const char* op, Fn&& fn) {
  PyObject* type = nullptr;
  std::string message;
  PyThreadState* const saved = PyEval_SaveThread();
  try {
    RECORD_FUNCTION(op, std::vector<c10::IValue>());
    fn();
  } catch (const flux::bindings::WorkspaceFailed& e) {
    type = g_workspace_error != nullptr ? g_workspace_error : PyExc_RuntimeError;
    message = e.what_without_backtrace();
  } catch (const flux::bindings::NoGraphTwin& e) {
    type = g_no_graph_twin != nullptr ? g_no_graph_twin : PyExc_RuntimeError;
    message = e.what_without_backtrace();
  } catch (const c10::ValueError& e) {
    type = PyExc_ValueError;
    message = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    type = PyExc_RuntimeError;
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    type = PyExc_RuntimeError;
    message = e.what();
  }
  PyEval_RestoreThread(saved);
  if (type == nullptr) return true;
  PyErr_SetString(type, message.c_str());
  return false;
}

// A direct call's arguments: `leading` integers (the workspace, the plan, then flags: what a decision binds), the
// operands (x, weight, bias | None), then `trailing` bools.
struct DirectArgs {
  int64_t leading[4] = {0, 0, 0, 0};
  Operands operands;
  std::optional<at::Tensor> x_scale, w_scale;  // FP8 calls: two more operands after the bias (None: absent)
  int64_t trailing = 0;
};

// 1: parsed; 0: not the plain case (the caller returns NotImplemented); -1: a Python error is set.
int parse(const char* op, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t leading, Py_ssize_t trailing,
          DirectArgs& out, bool scales = false) {
  Py_ssize_t const operands = scales ? 5 : 3;
  Py_ssize_t const expected = leading + operands + trailing;
  if (nargs != expected) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments, got %zd", op, expected, nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < expected; ++i) {
    if (i >= leading && i < leading + operands) continue;
    int64_t const v = PyLong_AsLongLong(args[i]);  // bools are ints
    if (v == -1 && PyErr_Occurred()) return -1;
    (i < leading ? out.leading[i] : out.trailing) = v;
  }
  if (scales) {  // the scales: plain tensors (never recorded by autograd) or None
    for (int j = 0; j < 2; ++j) {
      PyObject* const obj = args[leading + 3 + j];
      if (obj == Py_None) continue;
      const at::Tensor* t = plain_tensor(obj);
      if (t == nullptr || (at::GradMode::is_enabled() && t->requires_grad())) return 0;
      (j == 0 ? out.x_scale : out.w_scale) = *t;
    }
  }
  return plain_operands(args + leading, out.operands) ? 1 : 0;
}

PyObject* fast_ag_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  DirectArgs a;
  int const parsed = parse("ag_gemm", args, nargs, 4, 1, a);
  if (parsed <= 0) return parsed == 0 ? not_implemented() : nullptr;
  Operands const& o = a.operands;
  bool const return_gathered = a.trailing != 0;
  std::tuple<at::Tensor, at::Tensor> result;
  if (!call_released("flux_layers::ag_gemm", [&] {
        result = flux::bindings::ag_gemm(*o.x, *o.w, o.bias, a.leading[0], a.leading[1], a.leading[2] != 0,
                                         return_gathered, a.leading[3] != 0);
      }))
    return nullptr;
  PyObject* out = THPVariable_Wrap(std::get<0>(result));
  if (!return_gathered || out == nullptr) return out;
  PyObject* gathered = THPVariable_Wrap(std::get<1>(result));
  PyObject* pair = gathered != nullptr ? PyTuple_Pack(2, out, gathered) : nullptr;
  Py_DECREF(out);
  Py_XDECREF(gathered);
  return pair;
}

PyObject* fast_gemm_rs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  DirectArgs a;
  int const parsed = parse("gemm_rs", args, nargs, 3, 0, a);
  if (parsed <= 0) return parsed == 0 ? not_implemented() : nullptr;
  Operands const& o = a.operands;
  at::Tensor result;
  if (!call_released("flux_layers::gemm_rs", [&] {
        result = flux::bindings::gemm_rs(*o.x, *o.w, o.bias, a.leading[0], a.leading[1], a.leading[2] != 0);
      }))
    return nullptr;
  return THPVariable_Wrap(result);
}

// ag_gemm_fp8(workspace, plan, weight_nn, run_gemm, x, weight, bias, x_scale, w_scale, return_gathered):
// out, or (out, gathered, gathered_scale).
PyObject* fast_ag_gemm_fp8(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  DirectArgs a;
  int const parsed = parse("ag_gemm_fp8", args, nargs, 4, 1, a, true);
  if (parsed <= 0) return parsed == 0 ? not_implemented() : nullptr;
  Operands const& o = a.operands;
  bool const return_gathered = a.trailing != 0;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result;
  if (!call_released("flux_layers::ag_gemm_fp8", [&] {
        result = flux::bindings::ag_gemm_fp8(*o.x, *o.w, o.bias, a.x_scale, a.w_scale, a.leading[0], a.leading[1],
                                             a.leading[2] != 0, return_gathered, a.leading[3] != 0);
      }))
    return nullptr;
  if (!return_gathered) return THPVariable_Wrap(std::get<0>(result));
  PyObject* items[3] = {THPVariable_Wrap(std::get<0>(result)), THPVariable_Wrap(std::get<1>(result)),
                        THPVariable_Wrap(std::get<2>(result))};
  PyObject* triple = items[0] && items[1] && items[2] ? PyTuple_Pack(3, items[0], items[1], items[2]) : nullptr;
  for (PyObject* item : items) Py_XDECREF(item);
  return triple;
}

// gemm_rs_fp8(workspace, plan, weight_nn, x, weight, bias, x_scale, w_scale) -> out
PyObject* fast_gemm_rs_fp8(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  DirectArgs a;
  int const parsed = parse("gemm_rs_fp8", args, nargs, 3, 0, a, true);
  if (parsed <= 0) return parsed == 0 ? not_implemented() : nullptr;
  Operands const& o = a.operands;
  at::Tensor result;
  if (!call_released("flux_layers::gemm_rs_fp8", [&] {
        result = flux::bindings::gemm_rs_fp8(*o.x, *o.w, o.bias, a.x_scale, a.w_scale, a.leading[0], a.leading[1],
                                             a.leading[2] != 0);
      }))
    return nullptr;
  return THPVariable_Wrap(result);
}

// _set_error_types(workspace_error, no_graph_twin): the Python types of the typed failures, kept for the process.
PyObject* set_error_types(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || PyType_Check(args[0]) == 0 || PyType_Check(args[1]) == 0) {
    PyErr_SetString(PyExc_TypeError, "_set_error_types takes two exception types");
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XDECREF(g_workspace_error);
  Py_XDECREF(g_no_graph_twin);
  g_workspace_error = args[0];
  g_no_graph_twin = args[1];
  Py_RETURN_NONE;
}

// typed_error_probe(which): raises the typed failure `which` through this module's translation (tests).
PyObject* typed_error_probe(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Py_ssize_t size = 0;
  const char* which = nargs == 1 ? PyUnicode_AsUTF8AndSize(args[0], &size) : nullptr;
  if (which == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "typed_error_probe takes one str");
    return nullptr;
  }
  std::string const name(which, size_t(size));
  if (!call_released("flux_layers::typed_error_probe", [&] { flux::bindings::typed_error_probe(name); }))
    return nullptr;
  Py_RETURN_NONE;
}

// Whether a tensor's Python object holds its at::Tensor where TensorObject says.
bool layout_holds() {
  if (THPVariableClass == nullptr || ParameterClass == nullptr) return false;
  at::Tensor probe = at::empty({3});
  PyObject* obj = THPVariable_Wrap(probe);
  if (obj == nullptr) {
    PyErr_Clear();
    return false;
  }
  const at::Tensor* seen = plain_tensor(obj);
  bool const ok = seen != nullptr && seen->unsafeGetTensorImpl() == probe.unsafeGetTensorImpl();
  Py_DECREF(obj);
  return ok;
}

template <class Fn>
PyCFunction fastcall(Fn fn) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

PyMethodDef g_methods[] = {
    {"ag_gemm", fastcall(fast_ag_gemm), METH_FASTCALL,
     "torch.ops.flux_layers.ag_gemm without the op dispatch, its arguments as a decision binds them; NotImplemented "
     "where it does not apply"},
    {"gemm_rs", fastcall(fast_gemm_rs), METH_FASTCALL,
     "torch.ops.flux_layers.gemm_rs without the op dispatch, its arguments as a decision binds them; NotImplemented "
     "where it does not apply"},
    {"ag_gemm_fp8", fastcall(fast_ag_gemm_fp8), METH_FASTCALL,
     "torch.ops.flux_layers.ag_gemm_fp8 without the op dispatch (as ag_gemm, the scales after the bias)"},
    {"gemm_rs_fp8", fastcall(fast_gemm_rs_fp8), METH_FASTCALL,
     "torch.ops.flux_layers.gemm_rs_fp8 without the op dispatch (as gemm_rs, the scales after the bias)"},
    {"_set_error_types", fastcall(set_error_types), METH_FASTCALL,
     "the Python types of WorkspaceFailed and NoGraphTwin (flux_layers/_library.py, once)"},
    {"typed_error_probe", fastcall(typed_error_probe), METH_FASTCALL,
     "raises the typed failure named by its argument, as a fused call would (tests)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_C", "The fused ops' direct calls (csrc/bindings/fastcall.cpp)", -1,
                        nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  g_module.m_methods = layout_holds() ? g_methods : nullptr;
  return PyModule_Create(&g_module);
}
