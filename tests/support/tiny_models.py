"""Test helpers: tiny random HF models, their torch references and GGUF writing (needs torch + transformers,
imported lazily)."""
from __future__ import annotations

import os

TINY_SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}


def make_tiny_hf_model(family: str, *, tied: bool = False, seed: int = 0, **overrides):
  """A random tiny ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MixtralForCausalLM`` / ``MistralForCausalLM``
  (float32, eval mode). ``overrides`` go to the HF config (e.g. ``rope_parameters``, ``use_sliding_window``,
  ``num_local_experts``); Mixtral defaults to 4 experts, top-2."""
  import torch
  import transformers
  config_name, model_name = HF_CLASSES[family]
  kwargs = dict(TINY_SHAPES, tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
  if family == "llama":
    kwargs["rope_theta"] = 500.0
  if family == "mixtral":
    kwargs.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
  kwargs.update(overrides)
  torch.manual_seed(seed)
  model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs)).eval()
  with torch.no_grad():  # norms are 1 at init: randomize them so a mis-mapped norm weight shows
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
      elif name.endswith("gate.weight"):  # spread the router logits so top-k is far from ties
        p.mul_(20.0)
  return model


def save_tiny_hf_model(path: str, family: str, *, tied: bool = False, max_shard_size=None, seed: int = 0,
                       **overrides):
  """Saves a tiny random model as safetensors under ``path``; returns the torch model."""
  model = make_tiny_hf_model(family, tied=tied, seed=seed, **overrides)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(path, safe_serialization=True, **kwargs)
  assert os.path.isfile(os.path.join(path, "config.json"))
  return model


def torch_greedy(model, token_ids, max_new_tokens: int) -> list[int]:
  """transformers' greedy ``generate`` (KV-cached, no early stop): the new token ids."""
  import numpy as np
  import torch
  ids = torch.tensor(np.asarray(token_ids, np.int64)[None])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=[], pad_token_id=0)   # no stop token, and EOS is not masked either
  return out[0, ids.shape[1]:].tolist()


def torch_logits(model, token_ids) -> "np.ndarray":  # noqa: F821
  """``[len, vocab]`` float32 logits of one sequence from a transformers model."""
  import numpy as np
  import torch
  with torch.no_grad():
    out = model(torch.tensor(np.asarray(token_ids, np.int64)[None])).logits[0]
  return out.float().numpy()


def llama_cpp_permute(w, n_head: int):
  """llama.cpp's ``convert_hf_to_gguf`` q/k row permutation (HF half-split -> interleaved pairs)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF per-layer parameter suffix -> GGUF tensor suffix (llama.cpp's names), dense and Mixtral.
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.gate_exps": "ffn_gate_exps.weight",
    "mlp.experts.up_exps": "ffn_up_exps.weight", "mlp.experts.down_exps": "ffn_down_exps.weight"}


def write_gguf_from_hf_model(path: str, model, *, quantize_q8: bool = False) -> None:
  """Writes a transformers Llama (or Mixtral) model as a GGUF file the way llama.cpp's converter lays it out.

  F32 tensors (or Q8_0 for 2-D weights when ``quantize_q8``), q/k rows permuted, llama.* metadata; Mixtral
  as llama.cpp does: ``llama.expert_count`` / ``expert_used_count``, router ``ffn_gate_inp`` and merged
  ``ffn_{gate,up,down}_exps`` ``[E, out, in]`` tensors.
  """
  import gguf
  import numpy as np
  c = model.config
  w = gguf.GGUFWriter(path, "llama")
  _add_llama_metadata(w, c)
  for name, a in _hf_numpy_tensors(model):
    gname = _gguf_tensor_name(name, c)
    if gname is None:
      continue
    if gname.endswith("attn_q.weight"):
      a = llama_cpp_permute(a, c.num_attention_heads)
    elif gname.endswith("attn_k.weight"):
      a = llama_cpp_permute(a, c.num_key_value_heads)
    if quantize_q8 and a.ndim == 2:
      q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _add_llama_metadata(w, c) -> None:
  """The ``llama.*`` metadata of HF config ``c`` on GGUF writer ``w`` (expert counts for a Mixtral)."""
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
  w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
  w.add_vocab_size(c.vocab_size)
  if getattr(c, "num_local_experts", 0):
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)


def _hf_numpy_tensors(model) -> list:
  """``(HF name, float32 numpy array)`` of every state-dict tensor in order; a transformers-5 merged expert
  ``gate_up_proj [E, 2F, H]`` comes back as ``gate_exps`` then ``up_exps``, ``down_proj`` as ``down_exps``."""
  tensors = []
  for name, t in model.state_dict().items():
    a = t.detach().float().numpy()
    if name.endswith("mlp.experts.gate_up_proj"):         # transformers 5: [E, 2F, H] = gate ; up
      f = a.shape[1] // 2
      tensors += [(name.replace("gate_up_proj", "gate_exps"), a[:, :f]),
                  (name.replace("gate_up_proj", "up_exps"), a[:, f:])]
    elif name.endswith("mlp.experts.down_proj"):
      tensors.append((name.replace("down_proj", "down_exps"), a))
    else:
      tensors.append((name, a))
  return tensors


def _gguf_tensor_name(name: str, c):
  """The GGUF name of HF tensor ``name``; None for a tied ``lm_head`` (GGUF stores it once, as the embedding)."""
  if name == "model.embed_tokens.weight":
    return "token_embd.weight"
  if name == "model.norm.weight":
    return "output_norm.weight"
  if name == "lm_head.weight":
    return None if c.tie_word_embeddings else "output.weight"
  parts = name.split(".")
  return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:])]}"


def word_tokenizer(vocab_size):
  """A word-level ``tokenizers`` tokenizer: "w0".."w{V-3}" plus <s> = V-2 (bos) and </s> = V-1 (eos)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  vocab = {f"w{i}": i for i in range(vocab_size - 2)}
  vocab["<s>"], vocab["</s>"] = vocab_size - 2, vocab_size - 1
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
  tok.add_special_tokens([tokenizers.AddedToken("<s>", special=True), tokenizers.AddedToken("</s>", special=True)])
  return tok
