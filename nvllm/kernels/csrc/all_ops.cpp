// The library as one translation unit: each op's file includes the torch headers, whose
// parsing is most of an op file's compile time, so compiling them together parses them
// once and takes about half the CPU time of six separate compiles (the narrower-ISA test
// builds the library a second time, on the test machine's busy cores). The files keep
// their helpers in anonymous namespaces under distinct names; shared ones live in the
// headers.
#include "cpu_decode_attention.cpp"
#include "cpu_layer_ops.cpp"
#include "cpu_token_bitmask.cpp"
#include "cpu_argmax.cpp"
#include "cpu_quant_linear.cpp"
#include "cpu_quant_vnni.cpp"
#include "cpu_quant_a16.cpp"
#include "cpu_quant_amx.cpp"
#include "cpu_decode_stack.cpp"
