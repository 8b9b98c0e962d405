"""Checks the embedded default model: it loads with transformers, fits the size budget and writes English.
The word and loss oracles are validated against a random-weight model of the same shape, which must fail them."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[1] / "raylm" / "data" / "default_model"
SIZE_LIMIT_BYTES = 20 * 1024 * 1024
NEW_TOKENS = 80

# The 800 most frequent words of the training corpus (lower-cased runs of letters), which
# cover about 78% of its running words; computed once from the corpus so the test needs no data.
COMMON_WORDS = frozenset(
    """
    the and i to of a you my that in is d not it me with s for he his your be this but have
    as thou him so will what her do all by thy no if are shall we on o thee sir our lord
    good she now from they at come king which or love would let more ll here enter there
    well was then how their am when man them one hath than an know like go upon say may did
    make us yet were should must see why had out tis some such who give where first too
    these most can take mine speak t time think tell up much heart st duke never nor exeunt
    lady father doth exit look men day night great hear art life fair death hand made queen
    very sweet true master own away before god pray thus scene cannot eyes again ay other
    call any old honour heaven been world being caesar done two though nothing poor name er
    ever till son into both fear could leave comes blood down second whose even noble still
    antony therefore brother against way gentleman better nay myself those house stand
    brutus grace bear many hast wife find madam fool servant dead live every might part put
    show little daughter dear eye mistress word none peace keep within another clown friend
    off gone hold place bring best himself friends long die page head soul since young thine
    indeed mother whom stay has richard full face dost woman set aside after tongue nature
    else once boy iago answer ham rome about words faith please prince re three timon
    thought without lords forth mind othello thing makes marry said gentle welcome husband
    matter fortune does play gods ere morrow home romeo things bid cause unto john right
    heard came bed hope back follow act power rest truth farewell lie turn claudio use same
    fall ford end hence help earth rather kill macbeth fellow shame only hour state get
    antonio rosalind pardon hands cleopatra enough light soldier thank france hither meet
    gloster sword fire tears honest reason saw sure under thousand kind yourself wit ill
    false sea lay last cassio mean youth beauty troilus far wrong messenger news wilt
    strange shalt sleep lucius child swear mark new wish high yours each itself through lies
    seen letter mad thoughts present third henry lear prove cassius titus valentine believe
    desire speed don syracuse desdemona near breath body together foul left break sent
    dromio court means hector lost return proteus send between war room spirit villain
    business petruchio found while seem antipholus angelo told nurse ha coriolanus says half
    music sun beseech seek toby cousin worthy ye gold sorrow ho devil people alone juliet
    alas grief england benedick pity gave talk helena ne service menenius mrs gentlemen kiss
    maid berowne remember general ring purpose looks worth ear buckingham virtue fight friar
    citizen lose law cry arms falstaff majesty less work sister portia pandarus age knows
    horse sit draw loves care read yes pericles land joy happy patience save hang cold
    further leonato others crown air princess cressida something brought ephesus kent proud
    bloody anne holy sight fly born royal neither strong thyself company women parolles over
    serve goes ask free hate known comfort french black late days sad praise self quickly
    dare pass lives sound run demetrius orlando wear rich given achilles bastard sin bound
    york weep times hearts grave pleasure warrant attendants country wind fault charge
    olivia years uncle side doubt beatrice trust because watch behold arm either em need
    hell money heavy capulet haste touch mercy truly justice isabella ears hard certain
    pedro sake foot fit knave gracious didst cut julia wise bolingbroke almost thanks gives
    themselves highness ii deed enobarbus woe dog deep voice change paris knew having emilia
    lov coming prospero leontes note open married course water appear pompey ladies sick
    past th merry worse host tranio viola twas duty canst fie marcus command lest white
    straight field ground marcius question took strike bertram twenty report sing sebastian
    lips above ah hark hot sicinius lucio spoke tender en yea enemy captain next content
    shallow common chamber deliver moon de mouth sons guard apemantus soon needs confess
    signior murderer pistol malvolio withal eat slave drink ready oft just stands hours
    unless heavens walk murder ajax celia bassanio silvia palace sense grow door lucentio
    soldiers city pale revenge morning camillo want suit lead fare base person caius fast
    hero favour flesh e armado thersites methinks knight dream hortensio become oath wonder
    presently point met bless bad deny pr ythee baptista maria pretty bosom glad sworn five
    costard andrew bianca lafeu pluck wherefore already fell roman glou brave iii fetch bold
    provost office counsel seems wouldst shepherd conscience norfolk count attend spirits
    learn sport speaks green ulysses hamlet
""".split()
)

# Public-domain Shakespeare (Sonnet 18 and Hamlet III.i) for a perplexity check.
REFERENCE_PASSAGE = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date.

HAMLET:
To be, or not to be,--that is the question:--
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them?
"""


def english_word_share(text: str) -> tuple[float, int]:
    """Fraction of the words in text that are common corpus words, and how many distinct words it has."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words:
        return 0.0, 0
    return sum(word in COMMON_WORDS for word in words) / len(words), len(set(words))


def looks_like_english(text: str) -> bool:
    share, distinct = english_word_share(text)
    # Distinctness rules out a degenerate loop of one or two common tokens ("the the the").
    return share >= 0.6 and distinct >= 5


def greedy_continuation(model, tokenizer, prompt: str) -> str:
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def passage_loss(model, tokenizer) -> float:
    input_ids = tokenizer(REFERENCE_PASSAGE, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return loaded.eval()


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def random_model(request, model):
    torch.manual_seed(request.param)
    return transformers.AutoModelForCausalLM.from_config(model.config).eval()


def test_folder_fits_size_budget():
    files = [path for path in MODEL_DIR.iterdir() if path.is_file()]
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= {path.name for path in files}
    assert sum(path.stat().st_size for path in files) <= SIZE_LIMIT_BYTES


def test_config_is_small_gqa_llama(model):
    config = model.config
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


def test_tokenizer_is_fast_with_bos_and_eos(tokenizer, model):
    assert tokenizer.is_fast
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id
    ids = tokenizer("ROMEO: But soft!").input_ids
    assert ids[0] == tokenizer.bos_token_id
    # Byte-level BPE round-trips arbitrary text, including characters absent from the corpus.
    text = "ROMEO: But soft! \u00e9\u4e16 \U0001f600"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


def test_chat_template_renders(tokenizer):
    messages = [
        {"role": "system", "content": "Speak as a player."},
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay, answer me."},
        {"role": "user", "content": "Long live the king!"},
    ]
    history = (
        "SYSTEM: Speak as a player.\nUSER: Who is there?\nASSISTANT: Nay, answer me.</s>\nUSER: Long live the king!\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == history
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == history + "ASSISTANT:"


def test_reference_passage_loss_is_far_below_chance(model, tokenizer, random_model):
    chance = math.log(model.config.vocab_size)
    assert passage_loss(random_model, tokenizer) > chance - 0.5
    assert passage_loss(model, tokenizer) < chance - 2.5


def test_greedy_romeo_continuation_is_english(model, tokenizer):
    text = greedy_continuation(model, tokenizer, "ROMEO:")
    share, distinct = english_word_share(text)
    assert looks_like_english(text), f"share={share:.2f} distinct={distinct}: {text!r}"


def test_word_oracle_rejects_random_weights(random_model, tokenizer):
    text = greedy_continuation(random_model, tokenizer, "ROMEO:")
    assert not looks_like_english(text), text
