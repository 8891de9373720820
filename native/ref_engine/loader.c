/*
 * loader.c: the reference engine's baseRT.h entry points (native/basert_h.h), so a bundle of the
 * synthetic model is loaded by path exactly like a libbaseRT bundle.
 *
 * A reference "bundle file" is a small text descriptor (written by basertd.native.ref):
 *
 *     basertd-ref-bundle 1
 *     vocab_size = 512
 *     scripted_tokens = 7,8,9
 *     space = 0,1,0,0,1,0,0,kv          (id,kind,flags,blob_bytes,version_tag,cadence,interval,name)
 *     identity = <64 hex digits>
 *     chat_template = {{ bos_token }}...\n...   (\n, \t and \\ escapes)
 *
 * Keys: every integer field of BaseRTRefConfig, arch, identity, scripted_tokens, space (repeated),
 * and the bundle's tokenizer facts: add_bos (0/1: baseRT_encode prepends BOS), bos_token and
 * eos_token (their strings), chat_template, prefix_cache (0: the bundle cannot serve a prefix
 * cache, so BASERT_CAP_PREFIX_CACHE is never reported). '#' starts a comment line. An unknown key,
 * a bad number or a missing header line is BASERT_ERR_INVALID_FORMAT; a missing file
 * BASERT_ERR_FILE_NOT_FOUND; a config the engine refuses BASERT_ERR_INVALID_FORMAT too.
 *
 * Load options: opts->struct_size must equal sizeof(BaseRTLoadOptions) (else INVALID_ARGUMENT);
 * max_context > 0 caps the context length; max_batch_size > 0 sets max_lanes and max_batch_size.
 * Capabilities: HOST_LOGITS always; PAGED_KV and SEQUENCES when paged_kv was asked for;
 * PREFIX_CACHE when paged_kv and prefix_cache were asked for and the bundle allows it. The bits
 * report the load; the tick-ABI behaviour of the engine is the same either way.
 *
 * Tokenizer (the "bytes" vocabulary): ids 0 unk, 1 BOS, 2 EOS, 3 + b for byte b. baseRT_encode
 * turns the bos/eos token strings into their ids and every other byte into 3 + b, BOS first when
 * add_bos; it writes at most max_tokens ids and returns the count written. Ids 3..258 decode to
 * their byte, others below vocab_size to nothing; an id >= vocab_size is an invalid argument.
 *
 * Handles from baseRT_load_model_ex and baseRT_load_tokenizer_only are recorded in a registry;
 * baseRT_free_model frees both (and a baseRT_ref_create bundle). Errors are thread-local.
 */

#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basert_h.h"
#include "basert_ref.h"

#define LOADER_VERSION "0.3.0"
#define LOADER_HEADER "basertd-ref-bundle 1"
#define LOADER_MAX_SPACES 64u
#define LOADER_MAX_SCRIPT 65536u
#define BYTE_BASE 3u

typedef struct loaded {
    struct loaded *next;
    void *handle;      /* the ref bundle, or this record itself for a tokenizer-only handle */
    int bundle;        /* 1: handle is a ref bundle */
    uint32_t vocab_size;
    uint32_t eos_token;
    uint32_t context_length;
    int add_bos;
    int prefix_cache;  /* the bundle allows a prefix cache */
    uint32_t caps;
    char bos_str[64];
    char eos_str[64];
    char *chat_template;
    char *descriptor;
} loaded;

static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static loaded *g_loaded;
static _Thread_local char t_error[512];
static _Thread_local BaseRTErrorCode t_code;

static void set_error(BaseRTErrorCode code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof t_error, fmt, ap);
    va_end(ap);
    t_code = code;
}

static void clear_error(void) {
    t_error[0] = 0;
    t_code = BASERT_OK;
}

const char *baseRT_version_string(void) { return LOADER_VERSION; }
const char *baseRT_get_error(void) { return t_error; }
BaseRTErrorCode baseRT_get_error_code(void) { return t_code; }

static loaded *find(baseRT_model_t h) {
    if (!h)
        return NULL;
    pthread_mutex_lock(&g_reg_lock);
    loaded *l = g_loaded;
    while (l && l->handle != h)
        l = l->next;
    pthread_mutex_unlock(&g_reg_lock);
    return l;
}

static void record(loaded *l) {
    pthread_mutex_lock(&g_reg_lock);
    l->next = g_loaded;
    g_loaded = l;
    pthread_mutex_unlock(&g_reg_lock);
}

static loaded *unrecord(baseRT_model_t h) {
    pthread_mutex_lock(&g_reg_lock);
    loaded *found = NULL;
    for (loaded **p = &g_loaded; *p; p = &(*p)->next)
        if ((*p)->handle == h) {
            found = *p;
            *p = found->next;
            break;
        }
    pthread_mutex_unlock(&g_reg_lock);
    return found;
}

static void loaded_free(loaded *l) {
    if (!l)
        return;
    free(l->chat_template);
    free(l->descriptor);
    free(l);
}

/* ---- the descriptor file ---- */

typedef struct parsed {
    BaseRTRefConfig cfg;
    BaseRTRefSpace spaces[LOADER_MAX_SPACES];
    uint32_t *script;
    char arch[64];
    loaded *facts;
} parsed;

static int parse_u64(const char *s, uint64_t *out) {
    if (!*s || *s == '-')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_u32(const char *s, uint32_t *out) {
    uint64_t v;
    if (parse_u64(s, &v) || v > 0xFFFFFFFFull)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* Unescapes \n, \t, \\ in place. */
static void unescape(char *s) {
    char *w = s;
    for (char *r = s; *r; r++) {
        if (*r == '\\' && r[1]) {
            r++;
            *w++ = *r == 'n' ? '\n' : *r == 't' ? '\t' : *r;
        } else {
            *w++ = *r;
        }
    }
    *w = 0;
}

static int parse_space(char *v, BaseRTRefSpace *s) {
    char *fields[8];
    int n = 0;
    for (char *c = v; n < 8; n++) {
        fields[n] = c; /* empty fields count (a space may have no name) */
        char *comma = strchr(c, ',');
        if (!comma) {
            n++;
            break;
        }
        *comma = 0;
        c = comma + 1;
    }
    uint64_t blob, version;
    if (n != 8 || parse_u32(fields[0], &s->space_id) || parse_u32(fields[1], &s->kind) ||
        parse_u32(fields[2], &s->flags) || parse_u64(fields[3], &blob) || parse_u64(fields[4], &version) ||
        parse_u32(fields[5], &s->snapshot_cadence) || parse_u32(fields[6], &s->snapshot_interval_tokens) ||
        strlen(fields[7]) > 31)
        return -1;
    s->blob_bytes = blob;
    s->version_tag = version;
    strcpy(s->name, fields[7]);
    return 0;
}

static int parse_script(const char *v, parsed *p) {
    uint32_t n = 0;
    const char *c = v;
    if (!*c)
        return 0;
    free(p->script);
    p->script = malloc(LOADER_MAX_SCRIPT * sizeof *p->script);
    if (!p->script)
        return -1;
    while (*c) {
        char *end;
        errno = 0;
        unsigned long t = strtoul(c, &end, 10);
        if (errno || end == c || t > 0xFFFFFFFFul || n >= LOADER_MAX_SCRIPT)
            return -1;
        p->script[n++] = (uint32_t)t;
        if (*end == ',')
            end++;
        else if (*end)
            return -1;
        c = end;
    }
    p->cfg.scripted_tokens = p->script;
    p->cfg.n_scripted_tokens = n;
    return 0;
}

static int parse_identity(const char *v, uint8_t out[32]) {
    if (strlen(v) != 64)
        return -1;
    for (int i = 0; i < 32; i++) {
        unsigned int byte;
        if (!isxdigit((unsigned char)v[2 * i]) || !isxdigit((unsigned char)v[2 * i + 1]) ||
            sscanf(v + 2 * i, "%2x", &byte) != 1)
            return -1;
        out[i] = (uint8_t)byte;
    }
    return 0;
}

static int set_string(char *dst, size_t cap, const char *v) {
    if (strlen(v) >= cap)
        return -1;
    strcpy(dst, v);
    return 0;
}

/* One `key = value` line into p; 0 or -1 (unknown key or bad value). */
static int apply(parsed *p, const char *key, char *v) {
    BaseRTRefConfig *c = &p->cfg;
    uint64_t u;
    struct {
        const char *name;
        void *field;
        int wide;
    } ints[] = {
        {"vocab_size", &c->vocab_size, 0},         {"max_lanes", &c->max_lanes, 0},
        {"max_batch_size", &c->max_batch_size, 0}, {"page_size_tokens", &c->page_size_tokens, 0},
        {"bytes_per_token", &c->bytes_per_token, 1}, {"pool_bytes", &c->pool_bytes, 1},
        {"context_length", &c->context_length, 0}, {"eos_token", &c->eos_token, 0},
        {"eos_period", &c->eos_period, 0},         {"tick_delay_us", &c->tick_delay_us, 0},
        {"seed_lease_ticks", &c->seed_lease_ticks, 1}, {"kernel_caps", &c->kernel_caps, 1},
        {"n_layers", &c->n_layers, 0},
        {"prefill_step_tokens", &c->prefill_step_tokens, 0}, {"prefill_step_us", &c->prefill_step_us, 0},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        if (strcmp(key, ints[i].name))
            continue;
        if (ints[i].wide)
            return parse_u64(v, ints[i].field);
        return parse_u32(v, ints[i].field);
    }
    if (!strcmp(key, "arch"))
        return set_string(p->arch, sizeof p->arch, v);
    if (!strcmp(key, "identity"))
        return parse_identity(v, c->identity);
    if (!strcmp(key, "scripted_tokens"))
        return parse_script(v, p);
    if (!strcmp(key, "space")) {
        if (c->n_spaces >= LOADER_MAX_SPACES)
            return -1;
        if (parse_space(v, &p->spaces[c->n_spaces]))
            return -1;
        c->n_spaces++;
        c->spaces = p->spaces;
        return 0;
    }
    if (!strcmp(key, "add_bos") || !strcmp(key, "prefix_cache")) {
        if (parse_u64(v, &u) || u > 1)
            return -1;
        *(!strcmp(key, "add_bos") ? &p->facts->add_bos : &p->facts->prefix_cache) = (int)u;
        return 0;
    }
    if (!strcmp(key, "bos_token") || !strcmp(key, "eos_token_text")) {
        unescape(v);
        return !strcmp(key, "bos_token") ? set_string(p->facts->bos_str, sizeof p->facts->bos_str, v)
                                         : set_string(p->facts->eos_str, sizeof p->facts->eos_str, v);
    }
    if (!strcmp(key, "chat_template")) {
        unescape(v);
        free(p->facts->chat_template);
        p->facts->chat_template = strdup(v);
        return p->facts->chat_template ? 0 : -1;
    }
    return -1;
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

/* Reads the descriptor at path into p (facts allocated). 0, or -1 with the error set. */
static int parse_file(const char *path, parsed *p) {
    memset(p, 0, sizeof *p);
    baseRT_ref_config_init(&p->cfg);
    p->facts = calloc(1, sizeof *p->facts);
    if (!p->facts) {
        set_error(BASERT_ERR_OUT_OF_MEMORY, "out of memory");
        return -1;
    }
    p->facts->prefix_cache = 1;
    strcpy(p->facts->bos_str, "<s>");
    strcpy(p->facts->eos_str, "</s>");
    FILE *f = fopen(path, "r");
    if (!f) {
        set_error(errno == ENOENT ? BASERT_ERR_FILE_NOT_FOUND : BASERT_ERR_INVALID_ARGUMENT,
                  "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int lineno = 0, header = 0, rc = 0;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        char *s = trim(line);
        if (!*s || *s == '#')
            continue;
        if (!header) {
            if (strcmp(s, LOADER_HEADER)) {
                set_error(BASERT_ERR_INVALID_FORMAT, "%s: not a reference bundle (first line is not \"%s\")",
                          path, LOADER_HEADER);
                rc = -1;
                break;
            }
            header = 1;
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) {
            set_error(BASERT_ERR_INVALID_FORMAT, "%s:%d: expected key = value", path, lineno);
            rc = -1;
            break;
        }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        if (apply(p, key, val)) {
            set_error(BASERT_ERR_INVALID_FORMAT, "%s:%d: unknown key or bad value for %s", path, lineno, key);
            rc = -1;
            break;
        }
    }
    free(line);
    fclose(f);
    if (!rc && !header) {
        set_error(BASERT_ERR_INVALID_FORMAT, "%s: empty file, not a reference bundle", path);
        rc = -1;
    }
    if (!rc) {
        p->cfg.arch = p->arch[0] ? p->arch : NULL;
        p->facts->vocab_size = p->cfg.vocab_size;
        p->facts->eos_token = p->cfg.eos_token;
        p->facts->context_length = p->cfg.context_length;
    }
    return rc;
}

static void parsed_release(parsed *p, int keep_facts) {
    free(p->script);
    p->script = NULL;
    if (!keep_facts)
        loaded_free(p->facts);
    p->facts = NULL;
}

static char *make_descriptor(const BaseRTRefConfig *c, const loaded *l, int paged) {
    char *out = malloc(1024);
    if (!out)
        return NULL;
    const char *no_paged = "\"the bundle was loaded without paged KV\"";
    const char *pc = (l->caps & BASERT_CAP_PREFIX_CACHE) ? "true"
                     : !paged                             ? no_paged
                     : !l->prefix_cache ? "\"the bundle does not support a prefix cache\""
                                        : "\"prefix_cache was not requested at load\"";
    snprintf(out, 1024,
             "{\"descriptor_version\":1,\"engine\":\"basertd-ref\",\"workload\":\"text-generation\","
             "\"modalities\":{\"text\":true,\"image\":\"the reference engine has no vision tower "
             "until one is configured\"},"
             "\"serving\":{\"vocab_size\":%u,\"context_length\":%u,\"max_lanes\":%u,\"max_batch_size\":%u,"
             "\"page_size_tokens\":%u,\"pool_bytes\":%llu,\"sequences\":%s,\"host_logits\":true},"
             "\"state\":{\"paged_kv\":%s,\"prefix_cache\":%s},"
             "\"adaptation\":{\"lora\":\"the synthetic model has no weights\"},"
             "\"tick\":{\"ops\":true}}",
             c->vocab_size, c->context_length, c->max_lanes, c->max_batch_size, c->page_size_tokens,
             (unsigned long long)c->pool_bytes, paged ? "true" : no_paged, paged ? "true" : no_paged, pc);
    return out;
}

baseRT_model_t baseRT_load_model_ex(const char *model_path, const char *kernel_library_path, int max_context,
                                    const BaseRTLoadOptions *opts) {
    (void)kernel_library_path; /* the synthetic model runs no kernels */
    if (!model_path) {
        set_error(BASERT_ERR_INVALID_ARGUMENT, "model_path is NULL");
        return NULL;
    }
    if (opts && opts->struct_size != sizeof(BaseRTLoadOptions)) {
        set_error(BASERT_ERR_INVALID_ARGUMENT,
                  "BaseRTLoadOptions.struct_size is %zu, this library expects %zu (built against another "
                  "baseRT.h)",
                  opts->struct_size, sizeof(BaseRTLoadOptions));
        return NULL;
    }
    if (max_context < 0 || (opts && (opts->max_batch_size < 0 || opts->paged_kv < 0 || opts->prefix_cache < 0))) {
        set_error(BASERT_ERR_INVALID_ARGUMENT, "negative max_context or load option");
        return NULL;
    }
    parsed p;
    if (parse_file(model_path, &p)) {
        parsed_release(&p, 0);
        return NULL;
    }
    if (max_context > 0 && (uint32_t)max_context < p.cfg.context_length)
        p.cfg.context_length = (uint32_t)max_context;
    if (opts && opts->max_batch_size > 0)
        p.cfg.max_lanes = p.cfg.max_batch_size = (uint32_t)opts->max_batch_size;
    p.facts->context_length = p.cfg.context_length;
    baseRT_model_t bundle = NULL;
    baseRT_status st = baseRT_ref_create_checked(&p.cfg, &bundle);
    if (st) {
        set_error(st == BASERT_ERR_FATAL ? BASERT_ERR_OUT_OF_MEMORY : BASERT_ERR_INVALID_FORMAT,
                  "%s: the reference engine refuses this config (status %d)", model_path, (int)st);
        parsed_release(&p, 0);
        return NULL;
    }
    loaded *l = p.facts;
    int paged = opts && opts->paged_kv;
    l->caps = BASERT_CAP_HOST_LOGITS;
    if (paged)
        l->caps |= BASERT_CAP_PAGED_KV | BASERT_CAP_SEQUENCES;
    if (paged && opts->prefix_cache && l->prefix_cache)
        l->caps |= BASERT_CAP_PREFIX_CACHE;
    l->descriptor = make_descriptor(&p.cfg, l, paged);
    if (!l->descriptor) {
        baseRT_ref_free(bundle);
        parsed_release(&p, 0);
        set_error(BASERT_ERR_OUT_OF_MEMORY, "out of memory");
        return NULL;
    }
    l->handle = bundle;
    l->bundle = 1;
    parsed_release(&p, 1);
    record(l);
    clear_error();
    return bundle;
}

baseRT_model_t baseRT_load_tokenizer_only(const char *model_path) {
    if (!model_path) {
        set_error(BASERT_ERR_INVALID_ARGUMENT, "model_path is NULL");
        return NULL;
    }
    parsed p;
    if (parse_file(model_path, &p)) {
        parsed_release(&p, 0);
        return NULL;
    }
    loaded *l = p.facts;
    if (l->vocab_size < 2 || l->eos_token >= l->vocab_size) {
        set_error(BASERT_ERR_INVALID_FORMAT, "%s: vocabulary of %u ids with EOS %u", model_path, l->vocab_size,
                  l->eos_token);
        parsed_release(&p, 0);
        return NULL;
    }
    l->handle = l;
    l->bundle = 0;
    parsed_release(&p, 1);
    record(l);
    clear_error();
    return l;
}

void baseRT_free_model(baseRT_model_t model) {
    if (!model)
        return;
    loaded *l = unrecord(model);
    if (!l) {
        baseRT_ref_free(model); /* a baseRT_ref_create bundle (ignored if unknown) */
        return;
    }
    if (l->bundle)
        baseRT_ref_free(model);
    loaded_free(l);
}

uint32_t baseRT_capabilities(baseRT_model_t model) {
    loaded *l = find(model);
    return l ? l->caps : 0;
}

const char *baseRT_capability_descriptor(baseRT_model_t model) {
    loaded *l = find(model);
    return l && l->descriptor ? l->descriptor : "{}";
}

int baseRT_suggest_max_context(const char *model_path, int max_batch, int kv_bits, int paged_kv) {
    (void)max_batch;
    (void)kv_bits;
    (void)paged_kv;
    if (!model_path)
        return 0;
    parsed p;
    int rc = parse_file(model_path, &p) ? 0 : (int)p.cfg.context_length;
    parsed_release(&p, 0);
    return rc;
}

/* ---- tokenizer ---- */

static loaded *tok(baseRT_model_t model) {
    loaded *l = find(model);
    if (!l)
        set_error(BASERT_ERR_INVALID_ARGUMENT, "not a handle of baseRT_load_model_ex / load_tokenizer_only");
    return l;
}

static int encode_into(const loaded *l, const char *text, uint32_t *out, int max_tokens) {
    int n = 0;
    size_t bl = strlen(l->bos_str), el = strlen(l->eos_str);
    int bytes_ok = l->vocab_size >= BYTE_BASE + 256;
#define PUT(id)                                   \
    do {                                          \
        if (out && n < max_tokens)                \
            out[n] = (id);                        \
        n++;                                      \
    } while (0)
    if (l->add_bos)
        PUT(1u);
    for (const char *c = text; *c;) {
        if (bl && !strncmp(c, l->bos_str, bl)) {
            PUT(1u);
            c += bl;
        } else if (el && !strncmp(c, l->eos_str, el)) {
            PUT(l->eos_token);
            c += el;
        } else if (bytes_ok) {
            PUT(BYTE_BASE + (unsigned char)*c);
            c++;
        } else {
            PUT(0u); /* unk: the vocabulary has no byte ids */
            c++;
        }
    }
#undef PUT
    return n;
}

int baseRT_encode(baseRT_model_t model, const char *text, uint32_t *out_tokens, int max_tokens) {
    loaded *l = tok(model);
    if (!l)
        return 0;
    if (!text || (!out_tokens && max_tokens > 0) || max_tokens < 0) {
        set_error(BASERT_ERR_INVALID_ARGUMENT, "NULL text or output buffer");
        return 0;
    }
    int n = encode_into(l, text, out_tokens, max_tokens);
    clear_error();
    return n < max_tokens ? n : max_tokens;
}

int baseRT_token_count(baseRT_model_t model, const char *text) {
    loaded *l = tok(model);
    if (!l || !text)
        return 0;
    clear_error();
    return encode_into(l, text, NULL, 0);
}

int baseRT_decode_token_raw(baseRT_model_t model, uint32_t token_id, char *out, int max_bytes) {
    loaded *l = tok(model);
    if (!l)
        return -1;
    if (token_id >= l->vocab_size || max_bytes < 0 || (!out && max_bytes > 0)) {
        set_error(BASERT_ERR_INVALID_ARGUMENT, "token id %u outside the vocabulary of %u, or a bad buffer",
                  token_id, l->vocab_size);
        return -1;
    }
    clear_error();
    if (token_id < BYTE_BASE || token_id >= BYTE_BASE + 256)
        return 0;
    if (max_bytes >= 1)
        out[0] = (char)(token_id - BYTE_BASE);
    return 1;
}

uint32_t baseRT_bos_id(baseRT_model_t model) {
    loaded *l = tok(model);
    return l ? 1u : 0u;
}

uint32_t baseRT_eos_token_id(baseRT_model_t model) {
    loaded *l = tok(model);
    return l ? l->eos_token : 0u;
}

const char *baseRT_bos_token(baseRT_model_t model) {
    loaded *l = tok(model);
    return l ? l->bos_str : "";
}

const char *baseRT_eos_token(baseRT_model_t model) {
    loaded *l = tok(model);
    return l ? l->eos_str : "";
}

const char *baseRT_chat_template_jinja(baseRT_model_t model) {
    loaded *l = tok(model);
    return l && l->chat_template ? l->chat_template : "";
}
