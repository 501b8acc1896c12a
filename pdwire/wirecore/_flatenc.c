/* The compiled fast path of a flat message's encoder (pdwire.wirecore.flat).
 *
 * A FlatEncoder is built from a generated table (one entry per body position) and called like
 * the generated Python encoder: enc(msg, side) -> body list. It accepts exactly what the Python
 * encoder's inline tests accept and writes the same body; anything else (a value outside its
 * type, an int given for an enum, a list given for an array, a strided large array, no side
 * list) raises FlatBail, and the caller runs the generated Python encoder, which converts or
 * names what is wrong. It never classifies an error itself, so the two cannot disagree on one.
 *
 * Fields are read at their member offsets (msgspec Structs keep them in slots), so the message
 * must be of exactly the class the encoder was built for; the caller dispatches on type(msg).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

enum kind { K_CONST, K_INT, K_BOOL, K_STR, K_TYPE, K_ARRAY, K_ARRAY_LIST, K_ANY };

typedef struct {
    int kind;
    int optional;          /* None is written as None (K_ARRAY_LIST: for an item, never the list) */
    Py_ssize_t offset;     /* of the field in the message object; unused for K_CONST */
    PyObject *obj;         /* K_CONST: the value; K_TYPE: the exact type; arrays: the dtype */
    long long lo;          /* K_INT */
    unsigned long long hi; /* K_INT */
} Slot;

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    Py_ssize_t side_min; /* arrays of this many bytes or more become side frames */
    Py_ssize_t n;
    Slot *slots;
    vectorcallfunc vectorcall;
} FlatEncoder;

static PyObject *FlatBail;

static PyObject *
bail(const char *why)
{
    PyErr_SetString(FlatBail, why);
    return NULL;
}

/* An int inside [lo, hi]; the 64-bit cases without a second conversion where they fit. */
static int
int_fits(PyObject *v, const Slot *s)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow == 0) {
        if (x == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return x >= s->lo && (x < 0 || (unsigned long long)x <= s->hi);
    }
    if (overflow < 0 || s->hi <= (unsigned long long)LLONG_MAX) {
        return 0;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return u <= s->hi;
}

/* A 1-D array of exactly the slot's dtype: its bytes inline, or itself as the next side frame. */
static PyObject *
encode_array(PyObject *v, const Slot *s, PyObject *side, Py_ssize_t side_min)
{
    if (Py_TYPE(v) != &PyArray_Type) {
        return bail("not an ndarray");
    }
    PyArrayObject *a = (PyArrayObject *)v;
    if ((PyObject *)PyArray_DESCR(a) != s->obj || PyArray_NDIM(a) != 1 || !PyArray_IS_C_CONTIGUOUS(a)) {
        return bail("dtype, dimensions or layout");
    }
    npy_intp nbytes = PyArray_NBYTES(a);
    if (nbytes < side_min) {
        return PyBytes_FromStringAndSize(PyArray_DATA(a), nbytes);
    }
    if (side == Py_None) {
        return bail("no side frames");
    }
    if (PyList_Append(side, v) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(PyList_GET_SIZE(side) + 1); /* frames 0 and 1: header and body */
}

/* A list of (optional) arrays, item by item. The list is held for the whole loop, and its
 * length checked again after the allocation: PyList_New may run the collector, whose
 * finalizers may change the message. */
static PyObject *
encode_array_list(PyObject *v, const Slot *s, PyObject *side, Py_ssize_t side_min)
{
    if (!PyList_CheckExact(v)) {
        return bail("not a list");
    }
    Py_ssize_t n = PyList_GET_SIZE(v);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    if (PyList_GET_SIZE(v) != n) {
        Py_DECREF(out);
        return bail("list changed");
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = Py_NewRef(PyList_GET_ITEM(v, i));
        PyObject *x = e == Py_None && s->optional ? Py_NewRef(e) : encode_array(e, s, side, side_min);
        Py_DECREF(e);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *
encode_value(FlatEncoder *self, const Slot *s, PyObject *v, PyObject *side)
{
    if (v == Py_None && s->optional && s->kind != K_ARRAY_LIST) {
        return Py_NewRef(v);
    }
    switch (s->kind) {
    case K_ANY: /* what the Python encoder also passes as it is (bytes, lists of scalars) */
        return Py_NewRef(v);
    case K_INT:
        if (PyLong_CheckExact(v) && int_fits(v, s)) {
            return Py_NewRef(v);
        }
        return bail("int");
    case K_BOOL:
        if (v == Py_True || v == Py_False) {
            return Py_NewRef(v);
        }
        return bail("bool");
    case K_STR:
        if (PyUnicode_CheckExact(v)) {
            return Py_NewRef(v);
        }
        return bail("str");
    case K_TYPE:
        if (Py_TYPE(v) == (PyTypeObject *)s->obj) {
            return Py_NewRef(v);
        }
        return bail("type");
    case K_ARRAY:
        return encode_array(v, s, side, self->side_min);
    case K_ARRAY_LIST:
        return encode_array_list(v, s, side, self->side_min);
    }
    return bail("kind");
}

static PyObject *
encode_slot(FlatEncoder *self, const Slot *s, PyObject *msg, PyObject *side)
{
    if (s->kind == K_CONST) {
        /* a fresh list where the placeholder is one, as the Python encoder's literal is */
        return PyList_CheckExact(s->obj) ? PySequence_List(s->obj) : Py_NewRef(s->obj);
    }
    PyObject *v = *(PyObject **)((char *)msg + s->offset);
    if (v == NULL) {
        return bail("unset field");
    }
    Py_INCREF(v); /* held while encoding: nothing the encoding runs may free it */
    PyObject *out = encode_value(self, s, v, side);
    Py_DECREF(v);
    return out;
}

static PyObject *
FlatEncoder_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    FlatEncoder *self = (FlatEncoder *)callable;
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a flat encoder takes (message, side frames)");
        return NULL;
    }
    PyObject *msg = args[0], *side = args[1];
    if (Py_TYPE(msg) != self->cls) {
        return bail("another class");
    }
    if (side != Py_None && !PyList_CheckExact(side)) {
        return bail("side frames not a list");
    }
    PyObject *body = PyList_New(self->n);
    if (body == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *x = encode_slot(self, &self->slots[i], msg, side);
        if (x == NULL) {
            Py_DECREF(body);
            return NULL;
        }
        PyList_SET_ITEM(body, i, x);
    }
    return body;
}

/* --- construction from the generated table ------------------------------------------------ */

static const char *KIND_NAMES[] = {"const", "int", "bool", "str", "type", "array", "array_list", "any", NULL};

static int
member_offset(PyTypeObject *cls, PyObject *name, Py_ssize_t *offset)
{
    PyObject *descr = _PyType_Lookup(cls, name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%R is not a slot of %s", name, cls->tp_name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
    if (m->type != T_OBJECT_EX && m->type != T_OBJECT) {
        PyErr_Format(PyExc_TypeError, "%R of %s is not an object slot", name, cls->tp_name);
        return -1;
    }
    *offset = m->offset;
    return 0;
}

/* One table entry: (kind, field name or None, optional, obj, lo, hi). */
static int
parse_slot(PyTypeObject *cls, PyObject *entry, Slot *s)
{
    const char *kind;
    PyObject *name, *obj, *lo, *hi;
    int optional;
    if (!PyArg_ParseTuple(entry, "sOpOOO", &kind, &name, &optional, &obj, &lo, &hi)) {
        return -1;
    }
    int k = 0;
    while (KIND_NAMES[k] != NULL && strcmp(KIND_NAMES[k], kind) != 0) {
        k++;
    }
    if (KIND_NAMES[k] == NULL) {
        PyErr_Format(PyExc_ValueError, "unknown slot kind %s", kind);
        return -1;
    }
    s->kind = k;
    s->optional = optional;
    s->offset = 0;
    s->lo = 0;
    s->hi = 0;
    if (k != K_CONST && member_offset(cls, name, &s->offset) < 0) {
        return -1;
    }
    if (k == K_INT) {
        s->lo = PyLong_AsLongLong(lo);
        if (s->lo == -1 && PyErr_Occurred()) {
            return -1;
        }
        s->hi = PyLong_AsUnsignedLongLong(hi);
        if (s->hi == (unsigned long long)-1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if ((k == K_ARRAY || k == K_ARRAY_LIST) && !PyArray_DescrCheck(obj)) {
        PyErr_SetString(PyExc_TypeError, "an array slot needs a numpy dtype");
        return -1;
    }
    if (k == K_TYPE && !PyType_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a type slot needs a type");
        return -1;
    }
    s->obj = Py_NewRef(obj);
    return 0;
}

static void
FlatEncoder_dealloc(FlatEncoder *self)
{
    PyObject_GC_UnTrack(self);
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_XDECREF(self->slots[i].obj);
    }
    PyMem_Free(self->slots);
    Py_XDECREF(self->cls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FlatEncoder_traverse(FlatEncoder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_VISIT(self->slots[i].obj);
    }
    return 0;
}

static PyObject *
FlatEncoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cls", "table", "side_min", NULL};
    PyObject *cls, *table;
    Py_ssize_t side_min;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!n", kwlist, &PyType_Type, &cls, &PyTuple_Type, &table,
                                     &side_min)) {
        return NULL;
    }
    FlatEncoder *self = (FlatEncoder *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = FlatEncoder_vectorcall;
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->side_min = side_min;
    Py_ssize_t n = PyTuple_GET_SIZE(table);
    self->slots = PyMem_Calloc(n ? n : 1, sizeof(Slot));
    if (self->slots == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_slot(self->cls, PyTuple_GET_ITEM(table, i), &self->slots[i]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
        self->n = i + 1;
    }
    return (PyObject *)self;
}

static PyTypeObject FlatEncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pdwire.wirecore._flatenc.FlatEncoder",
    .tp_basicsize = sizeof(FlatEncoder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = FlatEncoder_new,
    .tp_dealloc = (destructor)FlatEncoder_dealloc,
    .tp_traverse = (traverseproc)FlatEncoder_traverse,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FlatEncoder, vectorcall),
    .tp_doc = "FlatEncoder(cls, table, side_min): enc(msg, side) -> body list, or FlatBail",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pdwire.wirecore._flatenc",
    .m_doc = "The compiled fast path of flat message encoders (see pdwire.wirecore.flat).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__flatenc(void)
{
    import_array();
    if (PyType_Ready(&FlatEncoderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    FlatBail = PyErr_NewException("pdwire.wirecore._flatenc.FlatBail", PyExc_Exception, NULL);
    if (FlatBail == NULL || PyModule_AddObjectRef(m, "FlatBail", FlatBail) < 0 ||
        PyModule_AddObjectRef(m, "FlatEncoder", (PyObject *)&FlatEncoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
