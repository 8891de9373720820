/* media.c: image media (probe, encode, release, bind) over a synthetic vision tower.
 *
 * A reference bundle has no tower until baseRT_ref_media_tower gives it one; until then probe and
 * encode are BASERT_ERR_OP_UNSUPPORTED (the ABI's answer for bundles without a tower) and no
 * media handle exists, so release and bind are UNKNOWN_HANDLE. The synthetic tower keys an image
 * by its path (the file is never opened): every image expands to tokens_per_image placeholder
 * tokens of image_token_id, wrapped by boi / eoi when those are set, and its features are a
 * digest of the path. Handles are (bundle serial << 32 | counter), never reused. Binds are
 * recorded per lane tag (before or after the admit) and dropped when the lane retires or the media
 * is released. The synthetic model does not splice features into a lane's state: like grammars,
 * media are tracked and validated, not applied. */

#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"

typedef struct ref_image {
    uint64_t handle;
    uint64_t features; /* digest of the path */
} ref_image;

typedef struct ref_bind {
    uint64_t lane_tag;
    uint64_t media;
    uint32_t token_offset;
    uint32_t _pad0;
} ref_bind;

typedef struct ref_media {
    uint32_t image_token_id, tokens_per_image, boi_token_id, eoi_token_id;
    uint32_t next;
    uint32_t n_images, cap_images;
    uint32_t n_binds, cap_binds;
    uint32_t _pad0;
    ref_image *images;
    ref_bind *binds;
} ref_media;

void ref_media_free_all(ref_bundle *b) {
    ref_media *m = b->media;
    if (m) {
        free(m->images);
        free(m->binds);
    }
    free(m);
    b->media = NULL;
}

static void drop_binds(ref_media *m, int by_lane, uint64_t key) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < m->n_binds; i++)
        if ((by_lane ? m->binds[i].lane_tag : m->binds[i].media) != key)
            m->binds[kept++] = m->binds[i];
    m->n_binds = kept;
}

void ref_media_lane_retired(ref_bundle *b, uint64_t lane_tag) {
    ref_media *m = b->media;
    if (m)
        drop_binds(m, 1, lane_tag);
}

static ref_image *image_find(ref_media *m, uint64_t handle) {
    for (uint32_t i = 0; m && i < m->n_images; i++)
        if (m->images[i].handle == handle)
            return &m->images[i];
    return NULL;
}

static void info_of(const ref_bundle *b, const ref_media *m, BaseRTMediaInfo *out) {
    ref_digest d;
    uint8_t fp[32];
    ref_digest_init(&d, 0x4D45444941u); /* "MEDIA": the preprocessing configuration */
    ref_digest_update(&d, b->identity, 32);
    ref_digest_u64(&d, m->tokens_per_image);
    ref_digest_u64(&d, m->image_token_id);
    ref_digest_final(&d, fp);
    memset(out, 0, sizeof *out);
    out->n_tokens = m->tokens_per_image;
    out->image_token_id = m->image_token_id;
    out->boi_token_id = m->boi_token_id;
    out->eoi_token_id = m->eoi_token_id;
    for (int i = 0; i < 8; i++)
        out->preprocess_fp |= (uint64_t)fp[i] << (8 * i);
}

/* Common checks of probe / encode: OP_UNSUPPORTED without a tower, BAD_STRUCT for a NULL or
 * empty path or a NULL out. */
static baseRT_status media_gate(const ref_bundle *b, const char *image_path, const void *out) {
    if (!b->media)
        return BASERT_ERR_OP_UNSUPPORTED;
    if (!image_path || !*image_path || !out)
        return BASERT_REJECT_BAD_STRUCT;
    return BASERT_STATUS_OK;
}

/* How many placeholders `image_path` expands to and the wrapper ids (no encoder run). */
baseRT_status baseRT_media_probe(baseRT_model_t bundle, const char *image_path, BaseRTMediaInfo *out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    if (!(rc = media_gate(b, image_path, out)))
        info_of(b, b->media, out);
    ref_unlock(b);
    return rc;
}

/* Encodes `image_path` into a new media handle (never reused on the bundle) and its info.
 * OP_UNSUPPORTED without a tower; BAD_STRUCT for NULL / empty arguments; FATAL out of memory. */
baseRT_status baseRT_media_encode(baseRT_model_t bundle, const char *image_path, uint64_t *media_handle,
                                  BaseRTMediaInfo *out) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_media *m = b->media;
    if (!(rc = media_gate(b, image_path, out)) && !media_handle)
        rc = BASERT_REJECT_BAD_STRUCT;
    if (!rc && (m->next == 0xFFFFFFFFu ||
                ref_reserve((void **)&m->images, &m->cap_images, (uint64_t)m->n_images + 1, sizeof *m->images)))
        rc = BASERT_ERR_FATAL;
    if (!rc) {
        ref_image *img = &m->images[m->n_images++];
        img->handle = (b->serial << 32) | ++m->next;
        img->features = ref_fnv1a64(image_path, strlen(image_path));
        *media_handle = img->handle;
        info_of(b, m, out);
    }
    ref_unlock(b);
    return rc;
}

/* Releases a media handle and every bind naming it; UNKNOWN_HANDLE when absent. */
baseRT_status baseRT_media_release(baseRT_model_t bundle, uint64_t media_handle) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_media *m = b->media;
    ref_image *img = image_find(m, media_handle);
    if (!img) {
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    } else {
        *img = m->images[--m->n_images];
        drop_binds(m, 0, media_handle);
    }
    ref_unlock(b);
    return rc;
}

/* Binds a media handle to lane `lane_tag` (admitted or not yet) at the prompt offset where its
 * placeholder run starts. UNKNOWN_HANDLE for an unknown handle; UNKNOWN_LANE for a faulted or
 * finished lane; BOUNDS when the run would end past an admitted lane's prompt or overlaps a run
 * already bound to the lane; FATAL out of memory. */
baseRT_status baseRT_media_bind(baseRT_model_t bundle, uint64_t lane_tag, uint64_t media_handle,
                                uint32_t token_offset) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_media *m = b->media;
    const ref_lane *l = ref_lane_find(b, lane_tag);
    uint64_t n = m ? m->tokens_per_image : 0, end = (uint64_t)token_offset + n;
    if (!image_find(m, media_handle))
        rc = BASERT_ERR_UNKNOWN_HANDLE;
    else if (l && l->state != REF_LANE_LIVE)
        rc = BASERT_REJECT_UNKNOWN_LANE;
    else if (l && end > l->prompt_len)
        rc = BASERT_REJECT_BOUNDS;
    for (uint32_t i = 0; !rc && i < m->n_binds; i++) {
        const ref_bind *o = &m->binds[i];
        if (o->lane_tag == lane_tag && token_offset < o->token_offset + n && o->token_offset < end)
            rc = BASERT_REJECT_BOUNDS;
    }
    if (!rc && ref_reserve((void **)&m->binds, &m->cap_binds, (uint64_t)m->n_binds + 1, sizeof *m->binds))
        rc = BASERT_ERR_FATAL;
    if (!rc) {
        ref_bind *bd = &m->binds[m->n_binds++];
        memset(bd, 0, sizeof *bd);
        bd->lane_tag = lane_tag;
        bd->media = media_handle;
        bd->token_offset = token_offset;
    }
    ref_unlock(b);
    return rc;
}

/* Test surface: gives the bundle a synthetic tower (basert_ref.h). BOUNDS for tokens_per_image 0
 * or a token id outside the vocabulary; a second call changes the tower for later images. */
baseRT_status baseRT_ref_media_tower(baseRT_model_t bundle, uint32_t image_token_id, uint32_t tokens_per_image,
                                     uint32_t boi_token_id, uint32_t eoi_token_id) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    uint32_t v = b->cfg.vocab_size;
    if (!tokens_per_image || image_token_id >= v || boi_token_id >= v || eoi_token_id >= v)
        rc = BASERT_REJECT_BOUNDS;
    else if (!b->media && !(b->media = calloc(1, sizeof(ref_media))))
        rc = BASERT_ERR_FATAL;
    if (!rc) {
        ref_media *m = b->media;
        m->image_token_id = image_token_id;
        m->tokens_per_image = tokens_per_image;
        m->boi_token_id = boi_token_id;
        m->eoi_token_id = eoi_token_id;
    }
    ref_unlock(b);
    return rc;
}
