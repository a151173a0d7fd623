import type { ServiceError } from "@grpc/grpc-js";

import { BadRequest, RetryInfo } from "./gen/google/rpc/error_details";
import { Status } from "./gen/google/rpc/status";

/** What a failed call's google.rpc.Status says, with the detail types EPD sends decoded. */
export interface StatusDetails {
  /** The whole status, or undefined when the server sent no details trailer. */
  status: Status | undefined;
  /** INVALID_ARGUMENT: one field violation per bad field (paths such as messages[0].parts[1].image.data). */
  badRequest: BadRequest | undefined;
  /** RESOURCE_EXHAUSTED: how long to wait before retrying. */
  retryInfo: RetryInfo | undefined;
}

const TYPE_URL_PREFIX = "type.googleapis.com/";

/**
 * Decodes the google.rpc.Status that an EPD service puts in the `grpc-status-details-bin`
 * trailer of a failed call (grpc-js hands trailers over as `error.metadata`).
 */
export function statusDetails(error: ServiceError): StatusDetails {
  const found: StatusDetails = { status: undefined, badRequest: undefined, retryInfo: undefined };
  const [raw] = error.metadata?.get("grpc-status-details-bin") ?? [];
  if (raw === undefined) {
    return found;
  }
  // Binary ("-bin") metadata arrives as a Buffer; a string would be base64.
  found.status = Status.decode(typeof raw === "string" ? Buffer.from(raw, "base64") : raw);
  for (const detail of found.status.details) {
    if (detail.typeUrl === TYPE_URL_PREFIX + "google.rpc.BadRequest") {
      found.badRequest = BadRequest.decode(detail.value);
    } else if (detail.typeUrl === TYPE_URL_PREFIX + "google.rpc.RetryInfo") {
      found.retryInfo = RetryInfo.decode(detail.value);
    }
  }
  return found;
}
