// Manifest: CSV form (round trip, quoting, every error path), routing rule, validation, presets.
#define BOOST_TEST_MODULE manifest
#include <boost/test/unit_test.hpp>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "normuon/manifest.h"
#include "normuon/presets.h"

using namespace normuon;

namespace {

using Shape = std::vector<int64_t>;

ParamSpec spec(std::string name, Shape shape, Role role = Role::matrix) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.role = role;
  return p;
}

Manifest parse(const std::string& text) {
  std::istringstream in(text);
  return Manifest::read_csv(in, "manifest.csv");
}

std::string to_csv(const Manifest& m) {
  std::ostringstream out;
  m.write_csv(out);
  return out.str();
}

void check_same(const Manifest& a, const Manifest& b) {
  BOOST_REQUIRE_EQUAL(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const ParamSpec& x = a.params[i];
    const ParamSpec& y = b.params[i];
    BOOST_TEST_CONTEXT("param #" << i << " " << x.name) {
      BOOST_TEST(x.name == y.name);
      BOOST_TEST(x.shape == y.shape, boost::test_tools::per_element());
      BOOST_TEST((x.dtype == y.dtype));
      BOOST_TEST((x.role == y.role));
      BOOST_TEST(x.group == y.group);
      BOOST_TEST((x.algorithm == y.algorithm));
      BOOST_TEST(x.transposed == y.transposed);
    }
  }
}

// Runs f, expects std::invalid_argument, and checks that its message contains every fragment.
template <class F>
void check_error(F f, std::initializer_list<std::string> fragments) {
  try {
    f();
    BOOST_ERROR("expected std::invalid_argument");
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const std::string& frag : fragments)
      BOOST_TEST(msg.find(frag) != std::string::npos, "message \"" << msg << "\" lacks \"" << frag << "\"");
  }
}

void check_csv_error(const std::string& text, std::initializer_list<std::string> fragments) {
  check_error([&] { parse(text); }, fragments);
}

const std::string kHeader = "name,shape,dtype,role,group,algorithm\n";

const ParamSpec& find(const Manifest& m, const std::string& name) {
  for (const ParamSpec& p : m.params)
    if (p.name == name) return p;
  throw std::runtime_error("no parameter " + name);
}

}  // namespace

// ---- shapes, enums ------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(shape_syntax) {
  BOOST_TEST(parse_shape("768x3072") == (Shape{768, 3072}), boost::test_tools::per_element());
  BOOST_TEST(parse_shape("2304") == (Shape{2304}), boost::test_tools::per_element());
  BOOST_TEST(parse_shape("").empty());
  BOOST_TEST(parse_shape("0x5") == (Shape{0, 5}), boost::test_tools::per_element());
  BOOST_TEST(parse_shape("2x3x4") == (Shape{2, 3, 4}), boost::test_tools::per_element());
  BOOST_TEST(shape_to_string({768, 3072}) == "768x3072");
  BOOST_TEST(shape_to_string({}) == "");

  check_error([] { parse_shape("12a"); }, {"bad extent \"12a\"", "768x3072"});
  check_error([] { parse_shape("-1"); }, {"bad extent \"-1\""});
  check_error([] { parse_shape("4x-1"); }, {"bad extent \"-1\""});
  check_error([] { parse_shape("768x"); }, {"bad extent \"\""});
  check_error([] { parse_shape("x"); }, {"bad extent"});
  check_error([] { parse_shape("768X3"); }, {"bad extent \"768X3\""});
  check_error([] { parse_shape(" 768"); }, {"bad extent"});
  check_error([] { parse_shape("99999999999999999999"); }, {"too large"});
  check_error([] { parse_shape("4294967296x4294967296"); }, {"too many elements"});
}

BOOST_AUTO_TEST_CASE(enum_names) {
  for (DType d : {DType::f32, DType::bf16, DType::f16}) BOOST_TEST((parse_dtype(to_string(d)) == d));
  for (Role r : {Role::matrix, Role::embedding, Role::head, Role::norm, Role::bias, Role::other, Role::router,
                 Role::experts})
    BOOST_TEST((parse_role(to_string(r)) == r));
  check_error([] { parse_dtype("f64"); }, {"\"f64\"", "f32", "bf16", "f16"});
  check_error([] { parse_role("weight"); }, {"\"weight\"", "matrix", "embedding", "head", "norm", "bias", "other", "router", "experts"});
}

// ---- routing and validation --------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(routing_by_role_and_rank) {
  for (Role r : {Role::matrix, Role::norm, Role::other, Role::experts})
    BOOST_TEST((route(spec("w", {8, 4}, r)) == Algorithm::normuon), to_string(r));
  for (Role r : {Role::embedding, Role::head, Role::router, Role::bias})  // biases at any rank: [E, f] of experts
    BOOST_TEST((route(spec("w", {8, 4}, r)) == Algorithm::adamw), to_string(r));
  BOOST_TEST((route(spec("b", {768}, Role::matrix)) == Algorithm::adamw));
  BOOST_TEST((route(spec("conv", {2, 3, 4}, Role::matrix)) == Algorithm::adamw));
  // An expert bank [E, m, n] is E matrices; one expert, as a layout holds it, is a matrix.
  BOOST_TEST((route(spec("experts.w1", {2, 3, 4}, Role::experts)) == Algorithm::normuon));
  BOOST_TEST((route(spec("experts.w1[0]", {3, 4}, Role::experts)) == Algorithm::normuon));
  BOOST_TEST((route(spec("experts.b", {2, 3}, Role::experts)) == Algorithm::normuon));
  BOOST_TEST((route(spec("experts.x", {2, 3, 4, 5}, Role::experts)) == Algorithm::adamw));
  BOOST_TEST((route(spec("experts.x", {3}, Role::experts)) == Algorithm::adamw));
  BOOST_TEST((route(spec("scale", {}, Role::matrix)) == Algorithm::adamw));
  BOOST_TEST((route(spec("empty1d", {0}, Role::matrix)) == Algorithm::adamw));
  // The rule looks at the rank only: a 0-element matrix is still a matrix.
  BOOST_TEST((route(spec("empty2d", {0, 768}, Role::matrix)) == Algorithm::normuon));
}

BOOST_AUTO_TEST_CASE(routing_overrides_and_groups) {
  ParamSpec emb = spec("wte", {100, 8}, Role::embedding);
  emb.algorithm = Algorithm::normuon;
  BOOST_TEST((route(emb) == Algorithm::normuon));
  ParamSpec mat = spec("w", {8, 4});
  mat.algorithm = Algorithm::adamw;
  BOOST_TEST((route(mat) == Algorithm::adamw));
  BOOST_TEST(resolved_group(mat) == "adamw");
  BOOST_TEST(resolved_group(spec("w", {8, 4})) == "normuon");
  BOOST_TEST(resolved_group(spec("b", {4}, Role::bias)) == "adamw");
  ParamSpec grouped = spec("w", {8, 4});
  grouped.group = "slow_matrices";
  BOOST_TEST(resolved_group(grouped) == "slow_matrices");

  for (const Shape& bad : {Shape{768}, Shape{2, 3, 4}, Shape{}}) {
    ParamSpec p = spec("h.0.ln.weight", bad, Role::norm);
    p.algorithm = Algorithm::normuon;
    check_error([&] { route(p); }, {"\"h.0.ln.weight\"", "routed to NorMuon", "NorMuon needs a 2-D matrix"});
  }
  ParamSpec p = spec("ln.weight", {768}, Role::norm);
  p.algorithm = Algorithm::normuon;
  check_error([&] { route(p); }, {"has shape [768]"});
  check_error([&] { resolved_group(p); }, {"\"ln.weight\""});
}

BOOST_AUTO_TEST_CASE(validate_errors) {
  Manifest ok;
  ok.params = {spec("a", {4, 4}), spec("b", {4}, Role::bias), spec("s", {})};
  BOOST_CHECK_NO_THROW(ok.validate());

  Manifest dup = ok;
  dup.params.push_back(spec("b", {2}));
  check_error([&] { dup.validate(); }, {"duplicate", "\"b\""});

  Manifest unnamed = ok;
  unnamed.params.push_back(spec("", {2}));
  check_error([&] { unnamed.validate(); }, {"empty name"});

  Manifest negative = ok;
  negative.params.push_back(spec("neg", {4, -1}));
  check_error([&] { negative.validate(); }, {"\"neg\"", "negative"});

  Manifest forced = ok;
  forced.params.push_back(spec("v", {3}));
  forced.params.back().algorithm = Algorithm::normuon;
  check_error([&] { forced.validate(); }, {"\"v\"", "NorMuon"});

  Manifest flipped = ok;  // only a matrix (or a bank) is stored [in, out]
  flipped.params[1].transposed = true;
  check_error([&] { flipped.validate(); }, {"\"b\"", "transposed", "[4]"});
  Manifest conv1d = ok;
  conv1d.params[0].transposed = true;
  conv1d.params.push_back(spec("bank", {2, 3, 4}, Role::experts));
  conv1d.params.back().transposed = true;
  BOOST_CHECK_NO_THROW(conv1d.validate());
}

// GPT-2's Conv1D weights are stored [in, out]: the column says so, and is written only when a parameter is.
BOOST_AUTO_TEST_CASE(csv_transposed_column) {
  Manifest m;
  m.params = {spec("c_attn", {4, 12}), spec("c_proj", {4, 4}), spec("bias", {4}, Role::bias)};
  BOOST_TEST(to_csv(m).rfind(kHeader, 0) == 0);  // none transposed: the six columns of earlier versions
  m.params[0].transposed = true;
  const std::string text = to_csv(m);
  BOOST_TEST(text.rfind("name,shape,dtype,role,group,algorithm,transposed\n", 0) == 0);
  BOOST_TEST(text.find("c_attn,4x12,f32,matrix,,auto,yes\n") != std::string::npos);
  check_same(parse(text), m);
  BOOST_TEST(parse("name,shape,transposed\nw,4x4,\nv,4x4,no\n").params[1].transposed == false);
  check_csv_error("name,shape,transposed\nw,4x4,maybe\n", {"manifest.csv:2", "'transposed'", "maybe"});
  check_csv_error("name,shape,transposed\nw,4,yes\n", {"manifest.csv:2", "'transposed'", "\"w\"", "[4]"});
}

// ---- CSV ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(csv_round_trip_presets) {
  for (const PresetInfo& info : list_presets()) {
    BOOST_TEST_CONTEXT(info.name) {
      const Manifest m = preset_manifest(info.name);
      const std::string text = to_csv(m);
      BOOST_TEST(text.rfind(kHeader, 0) == 0);
      check_same(parse(text), m);
    }
  }
}

BOOST_AUTO_TEST_CASE(csv_round_trip_awkward_values) {
  Manifest m;
  m.params = {spec("layers,0,weight", {4, 4}), spec("say \"hi\"", {4}, Role::bias),
              spec("two\nlines", {2, 3, 4}, Role::other), spec(" padded ", {}, Role::norm),
              spec("empty", {0, 8}), spec("embed", {10, 4}, Role::embedding)};
  m.params[0].dtype = DType::bf16;
  m.params[1].dtype = DType::f16;
  m.params[1].group = "group, with comma";
  m.params[4].algorithm = Algorithm::adamw;
  m.params[5].algorithm = Algorithm::normuon;
  m.params[5].group = "tied";
  check_same(parse(to_csv(m)), m);

  Manifest empty;
  BOOST_TEST(to_csv(empty) == kHeader);
  BOOST_TEST(parse(kHeader).params.empty());
}

BOOST_AUTO_TEST_CASE(csv_reading) {
  // Quoted names with commas, columns in another order, empty lines, "auto" and "" algorithms.
  const Manifest m = parse(
      "role,name,algorithm,shape,group,dtype\n"
      "\n"
      "matrix,\"blocks,0,attn\",auto,768x2304,,bf16\n"
      "  \n"
      "bias,\"b \"\"x\"\"\",,2304,mine,f32\n"
      "embedding,wte,normuon,50x8,,f16\n");
  BOOST_REQUIRE_EQUAL(m.params.size(), 3u);
  BOOST_TEST(m.params[0].name == "blocks,0,attn");
  BOOST_TEST(m.params[0].shape == (Shape{768, 2304}), boost::test_tools::per_element());
  BOOST_TEST((m.params[0].dtype == DType::bf16));
  BOOST_TEST(!m.params[0].algorithm.has_value());
  BOOST_TEST(m.params[1].name == "b \"x\"");
  BOOST_TEST(m.params[1].group == "mine");
  BOOST_TEST((m.params[1].role == Role::bias));
  BOOST_TEST(!m.params[1].algorithm.has_value());
  BOOST_TEST((m.params[2].algorithm == Algorithm::normuon));
  BOOST_TEST(m.numel() == 768 * 2304 + 2304 + 400);

  // Only name and shape are required; the rest take their defaults.
  const Manifest minimal = parse("shape,name\n4x4,w\n,scale\n");
  BOOST_REQUIRE_EQUAL(minimal.params.size(), 2u);
  BOOST_TEST((minimal.params[0].dtype == DType::f32));
  BOOST_TEST((minimal.params[0].role == Role::other));
  BOOST_TEST(minimal.params[0].group.empty());
  BOOST_TEST(!minimal.params[0].algorithm.has_value());
  BOOST_TEST(minimal.params[1].shape.empty());
  BOOST_TEST(minimal.params[1].numel() == 1);

  // Windows line endings.
  const Manifest crlf = parse("name,shape\r\nw,4x4\r\nb,4\r\n");
  BOOST_TEST(crlf.params.size() == 2u);
}

BOOST_AUTO_TEST_CASE(csv_errors_name_line_and_column) {
  check_csv_error(kHeader + "a,4x4,f32,matrix,,auto\n\n\n" + "b,12a,f32,matrix,,auto\n",
                  {"manifest.csv:5: column 'shape': bad extent \"12a\" (expected extents joined by 'x', "
                   "e.g. 768x3072)"});
  check_csv_error(kHeader + "a,-3,f32,bias,,\n", {"manifest.csv:2: column 'shape': bad extent \"-3\""});
  check_csv_error(kHeader + "a,4,f64,bias,,\n", {"manifest.csv:2: column 'dtype': unknown dtype \"f64\"", "bf16"});
  check_csv_error(kHeader + "a,4,f32,weight,,\n", {"manifest.csv:2: column 'role': unknown role \"weight\"", "embedding"});
  check_csv_error(kHeader + "a,4,,bias,,\n", {"manifest.csv:2: column 'dtype'"});
  check_csv_error(kHeader + "a,4x4,f32,matrix,,sgd\n", {"manifest.csv:2: column 'algorithm':", "sgd"});
  check_csv_error(kHeader + "w,4x4,f32,matrix,,\nln,768,f32,norm,,normuon\n",
                  {"manifest.csv:3: column 'algorithm':", "\"ln\"", "[768]", "NorMuon needs a 2-D matrix"});
  check_csv_error(kHeader + "w,4x4,f32,matrix,,\nv,4,f32,bias,,\nw,4,f32,bias,,\n",
                  {"manifest.csv:4: column 'name': duplicate parameter name \"w\" (first on line 2)"});
  check_csv_error(kHeader + ",4,f32,bias,,\n", {"manifest.csv:2: column 'name': empty parameter name"});
  check_csv_error(kHeader + "a,4,f32\n", {"manifest.csv:2:", "expected 6 fields", "got 3"});
  check_csv_error("name,dtype\nw,f32\n", {"manifest.csv:1:", "missing required column 'shape'"});
  check_csv_error("shape,dtype\n4,f32\n", {"manifest.csv:1:", "missing required column 'name'"});
  check_csv_error("name,shape,size\nw,4,4\n", {"manifest.csv:1:", "unknown column 'size'", "algorithm"});
  check_csv_error("name,shape,name\nw,4,v\n", {"manifest.csv:1:", "column 'name' appears twice"});
  check_csv_error("", {"manifest.csv", "header"});
  check_csv_error("\n\n", {"manifest.csv", "header"});
  check_csv_error(kHeader + "a,4,f32,bias,,\nb\"c,4,f32,bias,,\n", {"manifest.csv:3:", "malformed CSV"});
  check_csv_error(kHeader + "\"a,4,f32,bias,,\n", {"manifest.csv:", "malformed CSV"});
}

BOOST_AUTO_TEST_CASE(csv_line_numbers_follow_quoted_newlines) {
  // Line 2..3 hold one row whose name spans two lines; the bad row starts on line 4.
  check_csv_error(kHeader + "\"multi\nline\",4,f32,bias,,\nb,4,f32,cheese,,\n", {"manifest.csv:4: column 'role'"});
  check_csv_error(kHeader + "w,4,f32,bias,,\n\"multi\nline\",4,f32,cheese,,\n", {"manifest.csv:3: column 'role'"});
}

BOOST_AUTO_TEST_CASE(csv_files) {
  const std::string path = "test_manifest_tmp.csv";
  {
    std::ofstream out(path);
    preset_manifest("tiny").write_csv(out);
  }
  check_same(Manifest::read_csv_file(path), preset_manifest("tiny"));
  {
    std::ofstream out(path);
    out << kHeader << "w,4x,f32,matrix,,\n";
  }
  check_error([&] { Manifest::read_csv_file(path); }, {path + ":2: column 'shape'"});
  std::remove(path.c_str());
  check_error([] { Manifest::read_csv_file("/nonexistent/manifest.csv"); }, {"/nonexistent/manifest.csv"});
}

// ---- presets -----------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(preset_catalogue) {
  std::set<std::string> names;
  for (const PresetInfo& info : list_presets()) {
    names.insert(info.name);
    BOOST_TEST(!info.description.empty());
    BOOST_TEST(info.description.find("params") != std::string::npos, info.description);
    BOOST_CHECK_NO_THROW(preset_manifest(info.name).validate());
  }
  BOOST_TEST(names == (std::set<std::string>{"tiny", "gpt2-124m", "gpt-1.3b", "llama-1b", "moe-8x64"}),
             boost::test_tools::per_element());
  check_error([] { preset_manifest("gpt5"); },
              {"\"gpt5\"", "tiny", "gpt2-124m", "gpt-1.3b", "llama-1b", "moe-8x64"});
}

BOOST_AUTO_TEST_CASE(preset_gpt2) {
  const Manifest m = preset_manifest("gpt2-124m");
  BOOST_TEST(m.numel() == 124439808);
  BOOST_TEST(m.params.size() == 2u + 12u * 12u + 2u);
  BOOST_TEST(m.params.front().name == "transformer.wte.weight");
  BOOST_TEST(m.params.back().name == "transformer.ln_f.bias");
  BOOST_TEST((find(m, "transformer.wte.weight").role == Role::embedding));
  BOOST_TEST((find(m, "transformer.wpe.weight").shape == Shape{1024, 768}));
  BOOST_TEST((find(m, "transformer.h.0.attn.c_attn.weight").shape == Shape{2304, 768}));
  BOOST_TEST((find(m, "transformer.h.11.mlp.c_proj.weight").shape == Shape{768, 3072}));
  BOOST_TEST((find(m, "transformer.h.3.ln_2.weight").role == Role::norm));
  BOOST_TEST((find(m, "transformer.h.3.ln_2.bias").role == Role::bias));
  int normuon = 0;
  for (const ParamSpec& p : m.params) {
    BOOST_TEST(p.name != "lm_head.weight");
    BOOST_TEST((p.dtype == DType::f32));
    if (route(p) == Algorithm::normuon) {
      ++normuon;
      BOOST_TEST((p.role == Role::matrix), p.name);
    }
  }
  BOOST_TEST(normuon == 48);

  const Manifest tiny = preset_manifest("tiny");
  BOOST_TEST(tiny.numel() > 3000000);
  BOOST_TEST(tiny.numel() < 8000000);
  BOOST_TEST(tiny.params.back().name == "lm_head.weight");
  BOOST_TEST((tiny.params.back().shape == Shape{4096, 256}));
  BOOST_TEST((tiny.params.back().role == Role::head));
  BOOST_TEST((route(tiny.params.back()) == Algorithm::adamw));
  BOOST_TEST((find(tiny, "transformer.h.0.attn.c_attn.weight").shape == Shape{768, 256}));

  const Manifest big = preset_manifest("gpt-1.3b");
  BOOST_TEST(big.numel() > 1200000000);
  BOOST_TEST(big.numel() < 1400000000);
  for (const ParamSpec& p : big.params) BOOST_TEST((p.dtype == DType::bf16), p.name);
}

BOOST_AUTO_TEST_CASE(preset_llama) {
  const Manifest m = preset_manifest("llama-1b");
  BOOST_TEST(m.numel() > 1200000000);
  BOOST_TEST(m.numel() < 1400000000);
  BOOST_TEST(m.params.size() == 1u + 16u * 9u + 1u);
  BOOST_TEST(m.params.front().name == "model.embed_tokens.weight");
  BOOST_TEST((m.params.front().shape == Shape{128256, 2048}));
  BOOST_TEST((m.params.front().role == Role::embedding));
  BOOST_TEST(m.params.back().name == "model.norm.weight");

  const std::string l = "model.layers.7.";
  const Shape q = find(m, l + "self_attn.q_proj.weight").shape;
  const Shape k = find(m, l + "self_attn.k_proj.weight").shape;
  const Shape up = find(m, l + "mlp.up_proj.weight").shape;
  const Shape down = find(m, l + "mlp.down_proj.weight").shape;
  BOOST_TEST((k == Shape{512, 2048}));
  BOOST_TEST((find(m, l + "self_attn.v_proj.weight").shape == k));
  BOOST_TEST((q == Shape{2048, 2048}));
  BOOST_TEST((find(m, l + "self_attn.o_proj.weight").shape == q));
  BOOST_TEST((up == Shape{8192, 2048}));
  BOOST_TEST((find(m, l + "mlp.gate_proj.weight").shape == up));
  BOOST_TEST((down == Shape{2048, 8192}));
  BOOST_TEST((std::set<Shape>{q, k, up, down}.size() == 4u));
  BOOST_TEST((find(m, l + "input_layernorm.weight").role == Role::norm));

  int normuon = 0;
  for (const ParamSpec& p : m.params) {
    BOOST_TEST((p.dtype == DType::bf16), p.name);
    BOOST_TEST((p.role != Role::bias), p.name);
    BOOST_TEST(p.name != "lm_head.weight");
    if (route(p) == Algorithm::normuon) ++normuon;
  }
  BOOST_TEST(normuon == 16 * 7);
}

BOOST_AUTO_TEST_CASE(preset_moe) {
  const Manifest m = preset_manifest("moe-8x64");
  // 8 layers of (4 attention + 1 router + 64 x 3 expert matrices + 2 norms), embedding, final norm, head.
  BOOST_TEST(m.params.size() == 1u + 8u * (5u + 192u + 2u) + 2u);
  BOOST_TEST(m.numel() > 800000000);
  BOOST_TEST(m.numel() < 1000000000);
  const std::string l = "model.layers.5.";
  BOOST_TEST((find(m, l + "mlp.gate.weight").shape == Shape{64, 1024}));
  BOOST_TEST((find(m, l + "mlp.experts.63.gate_proj.weight").shape == Shape{512, 1024}));
  BOOST_TEST((find(m, l + "mlp.experts.0.up_proj.weight").shape == Shape{512, 1024}));
  BOOST_TEST((find(m, l + "mlp.experts.17.down_proj.weight").shape == Shape{1024, 512}));
  BOOST_TEST((find(m, l + "self_attn.k_proj.weight").shape == Shape{256, 1024}));
  BOOST_TEST((route(find(m, "lm_head.weight")) == Algorithm::adamw));
  BOOST_TEST((route(find(m, "model.embed_tokens.weight")) == Algorithm::adamw));

  int normuon = 0;
  for (const ParamSpec& p : m.params) {
    BOOST_TEST((p.dtype == DType::bf16), p.name);
    if (route(p) == Algorithm::normuon) ++normuon;
  }
  BOOST_TEST(normuon == 8 * (4 + 1 + 64 * 3));
}

// A manifest saved by a Windows editor starts with a UTF-8 byte order mark: read it as if it were not there.
BOOST_AUTO_TEST_CASE(csv_utf8_bom_is_skipped) {
  std::istringstream in("\xEF\xBB\xBFname,shape\nw,4x4\n");
  const Manifest m = Manifest::read_csv(in, "bom.csv");
  BOOST_REQUIRE(m.params.size() == 1u);
  BOOST_TEST(m.params[0].name == "w");
  BOOST_TEST((m.params[0].shape == std::vector<int64_t>{4, 4}));
  // Only at the very start: elsewhere it is part of a field, as any other bytes.
  std::istringstream later("name,shape\n\xEF\xBB\xBFw,4x4\n");
  BOOST_TEST(Manifest::read_csv(later, "later.csv").params[0].name == "\xEF\xBB\xBFw");
}
