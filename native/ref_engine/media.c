/* media.c: image media (probe, encode, bind, release).
 *
 * The reference engine has no vision tower: probe and encode are BASERT_ERR_OP_UNSUPPORTED, no
 * media handle is ever issued, so release and bind are BASERT_ERR_UNKNOWN_HANDLE. The media work
 * fills in ref_bundle.media and the two hooks (teardown, lane retired). */

#include "ref_internal.h"

void ref_media_free_all(ref_bundle *b) { b->media = NULL; }

void ref_media_lane_retired(ref_bundle *b, uint64_t lane_tag) {
    (void)b;
    (void)lane_tag;
}

static baseRT_status refuse(baseRT_model_t bundle, baseRT_status code) {
    baseRT_status rc;
    ref_bundle *b = ref_lock(bundle, &rc);
    if (!b)
        return rc;
    ref_unlock(b);
    return code;
}

baseRT_status baseRT_media_probe(baseRT_model_t bundle, const char *image_path, BaseRTMediaInfo *out) {
    (void)image_path;
    (void)out;
    return refuse(bundle, BASERT_ERR_OP_UNSUPPORTED);
}

baseRT_status baseRT_media_encode(baseRT_model_t bundle, const char *image_path, uint64_t *media_handle,
                                  BaseRTMediaInfo *out) {
    (void)image_path;
    (void)media_handle;
    (void)out;
    return refuse(bundle, BASERT_ERR_OP_UNSUPPORTED);
}

baseRT_status baseRT_media_release(baseRT_model_t bundle, uint64_t media_handle) {
    (void)media_handle;
    return refuse(bundle, BASERT_ERR_UNKNOWN_HANDLE);
}

baseRT_status baseRT_media_bind(baseRT_model_t bundle, uint64_t lane_tag, uint64_t media_handle,
                                uint32_t token_offset) {
    (void)lane_tag;
    (void)media_handle;
    (void)token_offset;
    return refuse(bundle, BASERT_ERR_UNKNOWN_HANDLE);
}
