// picompile_exec: an FX graph of torch ops run from C++, one Python call per step.
//
// runtime/graph_exec.py turns a decode graph whose every node is a torch operator (aten, picompile_native),
// an int operation on sizes, or a getitem into a list of instructions over a register file; Program runs
// them through the dispatcher's boxed calls. What the graph computes is unchanged (the same operators, on
// the same arguments, in the same order); what goes is the Python interpreter between them (~4 µs a call).
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ScalarOps.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;
using c10::IValue;

namespace {

// how one argument is made at run time: a constant, a register, or a list whose items are either
struct Arg {
  enum Kind { CONST, REG, INT_LIST, TENSOR_LIST, OPT_TENSOR_LIST } kind = CONST;
  IValue value;                                  // CONST
  int64_t reg = -1;                              // REG
  bool tensor = false;                           // REG: a Tensor argument (an int or float read as Python does)
  std::vector<std::pair<int64_t, int64_t>> items;  // lists: (register or -1, constant int)
};

struct Instr {
  enum Kind { OP, INT_BINOP, GETITEM } kind = OP;
  std::optional<c10::OperatorHandle> op;
  std::vector<Arg> args;
  int64_t binop = 0;      // INT_BINOP: 0 add, 1 sub, 2 mul, 3 floordiv
  int64_t index = 0;      // GETITEM
  std::vector<int64_t> outs;
  std::vector<int64_t> frees;  // registers read for the last time here
};

int64_t as_int(const IValue& v) {
  TORCH_CHECK(v.isInt(), "picompile_exec: expected an int, got ", v.tagKind());
  return v.toInt();
}

// a number where an operator takes a Tensor, as Python's binding passes it: a 0-d "wrapped number" tensor, which
// takes the other operand's dtype in type promotion
at::Tensor wrapped(const at::Scalar& s) {
  at::Tensor w = c10::scalar_to_tensor(s);
  w.unsafeGetTensorImpl()->set_wrapped_number(true);
  return w;
}

class Program {
 public:
  // instrs: tuples as graph_exec.py writes them; consts: (register, value); inputs / outputs: registers
  Program(int64_t n_regs, const py::list& consts, std::vector<int64_t> inputs, std::vector<int64_t> outputs,
          const py::list& instrs)
      : regs_(n_regs), inputs_(std::move(inputs)), outputs_(std::move(outputs)) {
    for (const auto& c : consts) {
      auto t = c.cast<py::tuple>();
      regs_[t[0].cast<int64_t>()] = torch::jit::toIValue(t[1], c10::AnyType::get());
    }
    for (const auto& i : instrs) code_.push_back(parse(i.cast<py::tuple>()));
  }

  py::tuple run(const std::vector<at::Tensor>& inputs) {
    TORCH_CHECK(inputs.size() == inputs_.size(), "picompile_exec: ", inputs_.size(), " inputs expected, got ",
                inputs.size());
    std::vector<IValue> out;
    {
      std::lock_guard<std::mutex> guard(lock_);
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < inputs.size(); ++i) regs_[inputs_[i]] = inputs[i];
      torch::jit::Stack stack;
      for (const Instr& ins : code_) {
        step(ins, stack);
        for (int64_t r : ins.frees) regs_[r] = IValue();
      }
      for (int64_t r : outputs_) out.push_back(regs_[r]);
      for (int64_t r : outputs_) regs_[r] = IValue();
      for (int64_t r : inputs_) regs_[r] = IValue();
    }
    py::tuple result(out.size());
    for (size_t i = 0; i < out.size(); ++i) result[i] = torch::jit::toPyObject(out[i]);
    return result;
  }

 private:
  Arg parse_arg(const py::handle& spec, const c10::TypePtr& type) {
    auto t = spec.cast<py::tuple>();
    const std::string kind = t[0].cast<std::string>();
    Arg a;
    if (kind == "r") {
      a.kind = Arg::REG;
      a.reg = t[1].cast<int64_t>();
      a.tensor = type && type->kind() == c10::TypeKind::TensorType;
    } else if (kind == "c") {
      a.kind = Arg::CONST;
      py::handle v = t[1];
      const bool number = py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v);
      if (type && type->kind() == c10::TypeKind::TensorType && number) {  // as Python passes it: a wrapped number
        a.value = wrapped(py::isinstance<py::bool_>(v) ? at::Scalar(v.cast<bool>())
                          : py::isinstance<py::int_>(v) ? at::Scalar(v.cast<int64_t>())
                                                         : at::Scalar(v.cast<double>()));
      } else {
        a.value = torch::jit::toIValue(v, type ? type : c10::AnyType::get());
      }
    } else if (kind == "d") {  // the schema's default
      a.kind = Arg::CONST;
    } else {
      a.kind = kind == "li" ? Arg::INT_LIST : kind == "lt" ? Arg::TENSOR_LIST : Arg::OPT_TENSOR_LIST;
      TORCH_CHECK(kind == "li" || kind == "lt" || kind == "lot", "picompile_exec: unknown argument kind ", kind);
      for (const auto& item : t[1].cast<py::list>()) {
        auto p = item.cast<py::tuple>();
        a.items.emplace_back(p[0].cast<int64_t>(), p[1].cast<int64_t>());
      }
    }
    return a;
  }

  Instr parse(const py::tuple& t) {
    Instr ins;
    const std::string kind = t[0].cast<std::string>();
    ins.outs = t[3].cast<std::vector<int64_t>>();
    ins.frees = t[4].cast<std::vector<int64_t>>();
    auto specs = t[2].cast<py::list>();
    if (kind == "op") {
      auto name = t[1].cast<py::tuple>();
      ins.op = c10::Dispatcher::singleton().findSchemaOrThrow(name[0].cast<std::string>().c_str(),
                                                              name[1].cast<std::string>().c_str());
      const auto& schema = ins.op->schema();
      TORCH_CHECK(specs.size() == schema.arguments().size(), "picompile_exec: ", schema.name(), " takes ",
                  schema.arguments().size(), " arguments, got ", specs.size());
      for (size_t i = 0; i < specs.size(); ++i) {
        const auto& arg = schema.arguments()[i];
        Arg a = parse_arg(specs[i], arg.type());
        if (a.kind == Arg::CONST && specs[i].cast<py::tuple>()[0].cast<std::string>() == "d") {
          TORCH_CHECK(arg.default_value().has_value(), "picompile_exec: ", schema.name(), "'s ", arg.name(),
                      " has no default");
          a.value = *arg.default_value();
        }
        ins.args.push_back(std::move(a));
      }
    } else {
      ins.kind = kind == "int" ? Instr::INT_BINOP : Instr::GETITEM;
      TORCH_CHECK(kind == "int" || kind == "getitem", "picompile_exec: unknown instruction ", kind);
      (kind == "int" ? ins.binop : ins.index) = t[1].cast<int64_t>();
      for (const auto& s : specs) ins.args.push_back(parse_arg(s, nullptr));
    }
    return ins;
  }

  IValue value(const Arg& a) const {
    switch (a.kind) {
      case Arg::CONST: return a.value;
      case Arg::REG: {
        const IValue& v = regs_[a.reg];
        if (a.tensor && (v.isInt() || v.isDouble() || v.isBool())) return wrapped(v.toScalar());
        return v;
      }
      case Arg::INT_LIST: {
        std::vector<int64_t> v;
        v.reserve(a.items.size());
        for (const auto& [r, c] : a.items) v.push_back(r >= 0 ? as_int(regs_[r]) : c);
        return IValue(v);
      }
      case Arg::TENSOR_LIST: {
        c10::List<at::Tensor> v;
        for (const auto& [r, c] : a.items) v.push_back(regs_[r].toTensor());
        return IValue(v);
      }
      case Arg::OPT_TENSOR_LIST: {
        c10::List<std::optional<at::Tensor>> v;
        for (const auto& [r, c] : a.items)
          v.push_back(r >= 0 ? std::optional<at::Tensor>(regs_[r].toTensor()) : std::nullopt);
        return IValue(v);
      }
    }
    return IValue();
  }

  void step(const Instr& ins, torch::jit::Stack& stack) {
    if (ins.kind == Instr::INT_BINOP) {
      const int64_t x = as_int(value(ins.args[0])), y = as_int(value(ins.args[1]));
      int64_t z = 0;
      switch (ins.binop) {
        case 0: z = x + y; break;
        case 1: z = x - y; break;
        case 2: z = x * y; break;
        default: {
          TORCH_CHECK(y != 0, "picompile_exec: integer division by zero");
          z = x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);  // Python's floor division
        }
      }
      regs_[ins.outs[0]] = IValue(z);
      return;
    }
    if (ins.kind == Instr::GETITEM) {
      IValue v = value(ins.args[0]);
      regs_[ins.outs[0]] = v.isTuple() ? v.toTupleRef().elements().at(ins.index) : v.toList().get(ins.index);
      return;
    }
    stack.clear();
    for (const Arg& a : ins.args) stack.push_back(value(a));
    ins.op->callBoxed(&stack);
    IValue& out = regs_[ins.outs.at(0)];
    if (stack.size() == 1) {
      out = std::move(stack[0]);
    } else if (stack.empty()) {
      out = IValue();
    } else {  // a multi-output op: a tuple, read by getitem
      out = c10::ivalue::Tuple::create(std::vector<IValue>(stack.begin(), stack.end()));
    }
  }

  std::vector<IValue> regs_;
  std::vector<int64_t> inputs_, outputs_;
  std::vector<Instr> code_;
  std::mutex lock_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program>(m, "Program")
      .def(py::init<int64_t, const py::list&, std::vector<int64_t>, std::vector<int64_t>, const py::list&>())
      .def("run", &Program::run);
}
