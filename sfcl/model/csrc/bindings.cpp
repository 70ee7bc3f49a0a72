// The Python module of SFCL's kernel library (PYBIND11_MODULE, named by the build:
// sfcl/model/decode_kernel.py). The other kernels are torch operators (torch.ops.sfcl.*, registered
// in their own files); the snapshot lookup's IVF pass is a plain pybind11 function instead, so it
// runs with the GIL held: a torch operator releases the GIL for its call, and in a server whose
// event loop thread is busy, taking it back cost the lookup up to the interpreter's switch interval
// (5 ms; p99 0.19 vs 2.2 ms with a busy Python thread beside it, docs/performance-journal.md,
// thirteenth session). Only pybind11 and ATen's headers: torch/extension.h doubles the build time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "sfcl_kernels.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace sfcl {
// AnchorSearch::run with the results as Python lists (scores, ids, confidences: B lists of k) and
// whether some row came back short (an id -1): no tensor is created (anchor_search.cpp's header).
// The served lookup's call: the index's 16 other arguments are converted and checked once, when
// sfcl.library.index.AnchorIndex binds them; converting them on every call cost a lookup right
// after a decode step ~15-20 us (twenty-fifth session).
inline pybind11::tuple anchor_lookup(AnchorSearch& pass, const at::Tensor& queries) {
  namespace py = pybind11;
  TORCH_CHECK(queries.dim() == 2, "anchor_lookup: queries must be a (B, D) tensor");
  const int64_t B = queries.size(0), k = pass.k();
  std::vector<float> S(B * k), F(B * k);
  std::vector<int64_t> I(B * k);
  pass.run(queries, S.data(), I.data(), F.data());
  py::list scores(B), ids(B), conf(B);
  bool short_row = false;
  for (int64_t b = 0; b < B; ++b) {
    py::list s(k), i(k), c(k);
    for (int64_t j = 0; j < k; ++j) {
      s[j] = py::float_(S[b * k + j]);
      i[j] = py::int_(I[b * k + j]);
      c[j] = py::float_(F[b * k + j]);
      short_row = short_row || I[b * k + j] < 0;
    }
    scores[b] = s;
    ids[b] = i;
    conf[b] = c;
  }
  return py::make_tuple(scores, ids, conf, short_row);
}

// How many of torch's intra-op threads an at::parallel_for over n items (grain 1) in this library
// runs on: 1 when the library was built without OpenMP, whatever torch.get_num_threads() says
// (decode_kernel.py, CFLAGS).
inline int64_t parallel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63)); });
  return __builtin_popcountll(seen.load());
}
}  // namespace sfcl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "SFCL's native CPU kernels (sfcl.model.decode_kernel)";
  const char* pass_doc =
      "The snapshot lookup's IVF pass (anchor_search.cpp), GIL held: queries (B, D) float32 "
      "contiguous, stored (N, D) float16, centroids (C, Dp / 2) uint8 (packed 4-bit codes, Dp = D rounded "
      "up to a multiple of 64), centroid_step (Dp,) float32, centroid_vectors (C, D) float16, offsets (C + 1,) int64, members (M,) int32, "
      "codes (M, Dp / 2) uint8 (the members' residuals from their centroid), code_step (Dp,) float32, "
      "weights and decay (N,) float32 or None; group_centroids (G, D) int8, group_scale (G,) float32, "
      "group_offsets (G + 1,) int64 (cells grouped: only the group_probe best groups' cells are "
      "ranked) or None. Scores, ids and confidences per row, best first, -inf / -1 / NaN where a row "
      "has no anchor, confidences NaN without weights. Raises RuntimeError for arguments that do not "
      "fit together.";
  m.def("anchor_search", &sfcl::anchor_search,
        (std::string(pass_doc) + " Returns (scores (B, k) float32, ids (B, k) int64, confidences (B, k) float32) tensors.").c_str(),
        py::arg("queries"), py::arg("stored"), py::arg("centroids"), py::arg("centroid_step"), py::arg("centroid_vectors"),
        py::arg("offsets"), py::arg("members"), py::arg("codes"), py::arg("code_step"), py::arg("nprobe"), py::arg("k"),
        py::arg("n_candidates"), py::arg("weights") = py::none(), py::arg("decay") = py::none(),
        py::arg("group_centroids") = py::none(), py::arg("group_scale") = py::none(), py::arg("group_offsets") = py::none(),
        py::arg("group_probe") = 0);
  py::class_<sfcl::AnchorSearch>(m, "AnchorLookup",
                                  "The served snapshot lookup's IVF pass over one index, its arguments (anchor_search's "
                                  "after queries) checked once and held. Calling it with queries (B, D) float32 "
                                  "contiguous returns (scores, ids, confidences, short): B Python lists of k each, and "
                                  "whether a row has an id -1 (no tensor created). The GIL is held; one call at a time.")
      .def(py::init<const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                    const c10::optional<at::Tensor>&, int64_t>(),
           py::arg("stored"), py::arg("centroids"), py::arg("centroid_step"), py::arg("centroid_vectors"),
           py::arg("offsets"), py::arg("members"), py::arg("codes"), py::arg("code_step"), py::arg("nprobe"),
           py::arg("k"), py::arg("n_candidates"), py::arg("weights") = py::none(), py::arg("decay") = py::none(),
           py::arg("group_centroids") = py::none(), py::arg("group_scale") = py::none(),
           py::arg("group_offsets") = py::none(), py::arg("group_probe") = 0)
      .def("__call__", &sfcl::anchor_lookup, py::arg("queries"));
  m.def("parallel_threads", &sfcl::parallel_threads,
        "Threads an at::parallel_for over n items (grain 1) runs on in this library (1 without OpenMP).",
        py::arg("n"));
}
