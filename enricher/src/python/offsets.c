/* offsetof() of what firn's CPython layouts name, against a version's own headers:
 * compiled and run by the test layouts_match_the_headers (python/tests.rs). */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#else
#include <frameobject.h>
#endif
#define P(name, v) printf("%s=%zu\n", name, (size_t)(v))
int main(void) {
  P("runtime.size", sizeof(_PyRuntimeState));
  P("runtime.interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
  P("runtime.interpreters_main", offsetof(_PyRuntimeState, interpreters.main));
#if PY_VERSION_HEX >= 0x030B0000
  P("interp.threads_head", offsetof(PyInterpreterState, threads.head));
#else
  P("interp.threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
  P("interp.size", sizeof(PyInterpreterState));
  P("tstate.size", sizeof(PyThreadState));
  P("tstate.next", offsetof(PyThreadState, next));
  P("tstate.thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030B0000
  P("tstate.native_thread_id", offsetof(PyThreadState, native_thread_id));
#endif
#if PY_VERSION_HEX >= 0x030D0000
  P("tstate.current_frame", offsetof(PyThreadState, current_frame));
#elif PY_VERSION_HEX >= 0x030B0000
  P("tstate.cframe", offsetof(PyThreadState, cframe));
  P("cframe.current_frame", offsetof(_PyCFrame, current_frame));
#else
  P("tstate.frame", offsetof(PyThreadState, frame));
#endif
#if PY_VERSION_HEX >= 0x030B0000
  P("frame.size", sizeof(_PyInterpreterFrame));
  P("frame.previous", offsetof(_PyInterpreterFrame, previous));
#if PY_VERSION_HEX >= 0x030D0000
  P("frame.code", offsetof(_PyInterpreterFrame, f_executable));
  P("frame.instr", offsetof(_PyInterpreterFrame, instr_ptr));
#else
  P("frame.code", offsetof(_PyInterpreterFrame, f_code));
  P("frame.instr", offsetof(_PyInterpreterFrame, prev_instr));
#endif
#if PY_VERSION_HEX >= 0x030C0000
  P("frame.owner", offsetof(_PyInterpreterFrame, owner));
  P("owner.cstack", FRAME_OWNED_BY_CSTACK);
#else
  P("frame.is_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
#else
  P("frame.size", sizeof(PyFrameObject));
  P("frame.previous", offsetof(PyFrameObject, f_back));
  P("frame.code", offsetof(PyFrameObject, f_code));
  P("frame.instr", offsetof(PyFrameObject, f_lasti));
#endif
  P("code.size", sizeof(PyCodeObject));
  P("code.filename", offsetof(PyCodeObject, co_filename));
  P("code.name", offsetof(PyCodeObject, co_name));
#if PY_VERSION_HEX >= 0x030B0000
  P("code.qualname", offsetof(PyCodeObject, co_qualname));
  P("code.co_code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#else
  P("code.co_code", offsetof(PyCodeObject, co_code));
#endif
  P("code.linetable", offsetof(PyCodeObject, co_linetable));
  P("code.firstlineno", offsetof(PyCodeObject, co_firstlineno));
  P("object.ob_type", offsetof(PyObject, ob_type));
  P("type.tp_name", offsetof(PyTypeObject, tp_name));
  P("type.tp_basicsize", offsetof(PyTypeObject, tp_basicsize));
  P("bytes.ob_size", offsetof(PyBytesObject, ob_base.ob_size));
  P("bytes.ob_sval", offsetof(PyBytesObject, ob_sval));
  P("unicode.state", offsetof(PyASCIIObject, state));
  P("unicode.length", offsetof(PyASCIIObject, length));
  P("unicode.asciiobject_size", sizeof(PyASCIIObject));
  return 0;
}
