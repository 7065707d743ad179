// The fused ops called from Python without torch's op dispatch: the module flux_layers._C (this library, imported
// by flux_layers/_library.py after torch.ops.load_library) with ag_gemm and gemm_rs, the same arguments and results as
// torch.ops.flux_layers.ag_gemm / gemm_rs and the same implementation (fused_calls.h).
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

// Reads `count` int64/bool arguments from args[first..]; false (with a Python error set) if one is not an integer.
bool read_ints(PyObject* const* args, Py_ssize_t first, Py_ssize_t count, int64_t* out) {
  for (Py_ssize_t i = 0; i < count; ++i) {
    out[i] = PyLong_AsLongLong(args[first + i]);  // bools are ints
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// Runs fn with the GIL released, translating C++ errors as torch does for op calls: c10::ValueError -> ValueError,
// other errors -> RuntimeError. Returns false with the Python error set.
template <class Fn>
bool call_released(Fn&& fn) {
  PyObject* type = nullptr;
  std::string message;
  PyThreadState* const saved = PyEval_SaveThread();
  try {
    fn();
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

bool wrong_count(const char* op, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return false;
  PyErr_Format(PyExc_TypeError, "%s takes %zd positional arguments, got %zd", op, expected, nargs);
  return true;
}

// ag_gemm(x_shard_m, weight, bias | None, workspace, plan, weight_nn, return_gathered, run_gemm) -> (out, gathered)
PyObject* fast_ag_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (wrong_count("ag_gemm", nargs, 8)) return nullptr;
  Operands o;
  if (!plain_operands(args, o)) return not_implemented();
  int64_t v[5];
  if (!read_ints(args, 3, 5, v)) return nullptr;
  std::tuple<at::Tensor, at::Tensor> result;
  bool const ok = call_released([&] {
    RECORD_FUNCTION("flux_layers::ag_gemm", std::vector<c10::IValue>());
    result = flux::bindings::ag_gemm(*o.x, *o.w, o.bias, v[0], v[1], v[2] != 0, v[3] != 0, v[4] != 0);
  });
  if (!ok) return nullptr;
  PyObject* out = THPVariable_Wrap(std::get<0>(result));
  PyObject* gathered = out != nullptr ? THPVariable_Wrap(std::get<1>(result)) : nullptr;
  PyObject* pair = gathered != nullptr ? PyTuple_Pack(2, out, gathered) : nullptr;
  Py_XDECREF(out);
  Py_XDECREF(gathered);
  return pair;
}

// gemm_rs(x, weight, bias | None, workspace, plan, weight_nn) -> out
PyObject* fast_gemm_rs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (wrong_count("gemm_rs", nargs, 6)) return nullptr;
  Operands o;
  if (!plain_operands(args, o)) return not_implemented();
  int64_t v[3];
  if (!read_ints(args, 3, 3, v)) return nullptr;
  at::Tensor result;
  bool const ok = call_released([&] {
    RECORD_FUNCTION("flux_layers::gemm_rs", std::vector<c10::IValue>());
    result = flux::bindings::gemm_rs(*o.x, *o.w, o.bias, v[0], v[1], v[2] != 0);
  });
  return ok ? THPVariable_Wrap(result) : nullptr;
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

PyMethodDef g_methods[] = {
    {"ag_gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_ag_gemm)), METH_FASTCALL,
     "torch.ops.flux_layers.ag_gemm without the op dispatch; NotImplemented where it does not apply"},
    {"gemm_rs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_gemm_rs)), METH_FASTCALL,
     "torch.ops.flux_layers.gemm_rs without the op dispatch; NotImplemented where it does not apply"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_C", "The fused ops' direct calls (csrc/bindings/fastcall.cpp)", -1,
                        nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  g_module.m_methods = layout_holds() ? g_methods : nullptr;
  return PyModule_Create(&g_module);
}
