// A Node client of the EPD gateway on the generated TypeScript SDK (@epd/client, sdk/ts).
//
//   node dist/main.js generate    --address HOST:PORT --image cat.png [--prompt P] [--max-tokens N] [--min-tokens N]
//   node dist/main.js bad-request --address HOST:PORT [--max-tokens N]
//   node dist/main.js abort       --address HOST:PORT --image cat.png --request-id ID [--after N]
//   node dist/main.js deadline    --address HOST:PORT --image cat.png [--deadline-ms MS]
//   node dist/main.js services    --address HOST:PORT
//
// Each command prints one JSON object on stdout (tests/test_node_client.py reads it) and exits
// 0 when the call behaved as the contract says, 1 otherwise.
import { readFileSync } from "node:fs";
import * as path from "node:path";

import { common, gateway, grpc, health, reflection, statusDetails } from "@epd/client";

type Args = Record<string, string>;

function parseArgs(argv: string[]): { command: string; args: Args } {
  const [command = "", ...rest] = argv;
  const args: Args = {};
  for (let i = 0; i < rest.length; i += 2) {
    const key = rest[i];
    const value = rest[i + 1];
    if (!key.startsWith("--") || value === undefined) {
      throw new Error(`expected --name value pairs, got ${JSON.stringify(rest.slice(i))}`);
    }
    args[key.slice(2)] = value;
  }
  return { command, args };
}

function required(args: Args, name: string): string {
  const value = args[name];
  if (value === undefined) {
    throw new Error(`--${name} is required`);
  }
  return value;
}

const MIME_TYPES: Record<string, string> = { ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp" };

/** One user message: an image, then the prompt. */
function imageRequest(args: Args, extra: Partial<common.SamplingParams> = {}): gateway.GenerateRequest {
  const image = required(args, "image");
  return gateway.GenerateRequest.fromPartial({
    requestId: args["request-id"] ?? "",
    messages: [
      {
        role: gateway.Role.ROLE_USER,
        parts: [
          { image: { data: readFileSync(image), mimeType: MIME_TYPES[path.extname(image).toLowerCase()] ?? "image/png" } },
          { text: args.prompt ?? "Describe this image." },
        ],
      },
    ],
    sampling: {
      maxTokens: Number(args["max-tokens"] ?? 16),
      minTokens: Number(args["min-tokens"] ?? 0),
      temperature: 0, // greedy: unset would mean 1.0
      ...extra,
    },
  });
}

function newClient<T>(Client: new (address: string, credentials: grpc.ChannelCredentials) => T, args: Args): T {
  return new Client(required(args, "address"), grpc.credentials.createInsecure());
}

function deadlineIn(ms: number): Date {
  return new Date(Date.now() + ms);
}

function durationSeconds(d: { seconds: number; nanos: number } | undefined): number {
  return d === undefined ? 0 : d.seconds + d.nanos / 1e9;
}

interface StreamResult {
  tokenIds: number[];
  text: string;
  deltas: number;
  finished: gateway.GenerateFinished | undefined;
  error: grpc.ServiceError | undefined;
}

/** Reads a Generate stream to its end; `onDelta` sees each delta as it arrives. */
function readStream(call: grpc.ClientReadableStream<gateway.GenerateResponse>, onDelta?: (count: number) => void): Promise<StreamResult> {
  const result: StreamResult = { tokenIds: [], text: "", deltas: 0, finished: undefined, error: undefined };
  return new Promise((resolve) => {
    call.on("data", (response: gateway.GenerateResponse) => {
      if (response.delta !== undefined) {
        result.tokenIds.push(...response.delta.tokenIds);
        result.text += response.delta.text;
        result.deltas += 1;
        onDelta?.(result.deltas);
      } else if (response.finished !== undefined) {
        result.finished = response.finished;
      }
    });
    call.on("error", (error: grpc.ServiceError) => {
      result.error = error;
      resolve(result);
    });
    call.on("end", () => resolve(result));
  });
}

function finishedJson(finished: gateway.GenerateFinished | undefined): object | null {
  if (finished === undefined) {
    return null;
  }
  const t = finished.timings;
  return {
    finishReason: common.finishReasonToJSON(finished.finishReason),
    usage: finished.usage ?? null,
    timings: {
      encodeS: durationSeconds(t?.encode),
      prefillS: durationSeconds(t?.prefill),
      decodeS: durationSeconds(t?.decode),
      timeToFirstTokenS: durationSeconds(t?.timeToFirstToken),
      totalS: durationSeconds(t?.total),
    },
  };
}

function codeName(error: grpc.ServiceError | undefined): string | null {
  return error === undefined ? null : grpc.status[error.code];
}

/** Streams one image request and reports its tokens. */
async function generate(args: Args): Promise<boolean> {
  const client = newClient(gateway.GatewayServiceClient, args);
  const result = await readStream(client.generate(imageRequest(args), { deadline: deadlineIn(120_000) }));
  client.close();
  print({ tokenIds: result.tokenIds, text: result.text, deltas: result.deltas, code: codeName(result.error), finished: finishedJson(result.finished) });
  return result.error === undefined && result.finished !== undefined;
}

/** A request with an undecodable image (and `--max-tokens`, 4 by default): INVALID_ARGUMENT
 *  whose google.rpc.BadRequest names each bad field. */
async function badRequest(args: Args): Promise<boolean> {
  const client = newClient(gateway.GatewayServiceClient, args);
  const request = gateway.GenerateRequest.fromPartial({
    messages: [{ role: gateway.Role.ROLE_USER, parts: [{ image: { data: Buffer.from("not an image"), mimeType: "image/png" } }, { text: "Describe this." }] }],
    sampling: { maxTokens: Number(args["max-tokens"] ?? 4), temperature: 0 },
  });
  const result = await readStream(client.generate(request, { deadline: deadlineIn(60_000) }));
  client.close();
  const details = result.error === undefined ? undefined : statusDetails(result.error);
  print({
    code: codeName(result.error),
    message: result.error?.details ?? null,
    violations: details?.badRequest?.fieldViolations.map((v) => ({ field: v.field, description: v.description })) ?? [],
  });
  return result.error?.code === grpc.status.INVALID_ARGUMENT && (details?.badRequest?.fieldViolations.length ?? 0) > 0;
}

/** Streams a long request, aborts it by id after `--after` deltas, and reports how it ended. */
async function abort(args: Args): Promise<boolean> {
  const client = newClient(gateway.GatewayServiceClient, args);
  const requestId = required(args, "request-id");
  const after = Number(args.after ?? 3);
  let abortError: grpc.ServiceError | null = null;
  let aborted: Promise<void> | undefined;
  const call = client.generate(imageRequest(args, { maxTokens: 2000, minTokens: 2000 }), { deadline: deadlineIn(120_000) });
  const result = await readStream(call, (deltas) => {
    if (deltas === after) {
      aborted = new Promise((resolve) =>
        client.abort({ requestId }, new grpc.Metadata(), { deadline: deadlineIn(10_000) }, (error) => {
          abortError = error;
          resolve();
        }),
      );
    }
  });
  await aborted;
  client.close();
  print({ streamedTokens: result.tokenIds.length, deltas: result.deltas, code: codeName(result.error), abortCode: codeName(abortError ?? undefined), finished: finishedJson(result.finished) });
  return abortError === null && result.finished?.finishReason === common.FinishReason.FINISH_REASON_ABORT;
}

/** A long request under a short deadline: DEADLINE_EXCEEDED. */
async function deadline(args: Args): Promise<boolean> {
  const client = newClient(gateway.GatewayServiceClient, args);
  const ms = Number(args["deadline-ms"] ?? 1500);
  const started = Date.now();
  const result = await readStream(client.generate(imageRequest(args, { maxTokens: 2000, minTokens: 2000 }), { deadline: deadlineIn(ms) }));
  client.close();
  print({ code: codeName(result.error), streamedTokens: result.tokenIds.length, elapsedMs: Date.now() - started, finished: finishedJson(result.finished) });
  return result.error?.code === grpc.status.DEADLINE_EXCEEDED;
}

/** Lists services through grpc.reflection.v1 and checks liveness and readiness health. */
async function services(args: Args): Promise<boolean> {
  const reflectionClient = newClient(reflection.ServerReflectionClient, args);
  const listed = await new Promise<string[]>((resolve, reject) => {
    const stream = reflectionClient.serverReflectionInfo({ deadline: deadlineIn(10_000) });
    stream.on("data", (response: reflection.ServerReflectionResponse) => {
      if (response.errorResponse !== undefined) {
        reject(new Error(`reflection error ${response.errorResponse.errorCode}: ${response.errorResponse.errorMessage}`));
      } else {
        resolve((response.listServicesResponse?.service ?? []).map((s) => s.name));
      }
      stream.end();
    });
    stream.on("error", reject);
    stream.write(reflection.ServerReflectionRequest.fromPartial({ listServices: "" }));
  });
  reflectionClient.close();
  const healthClient = newClient(health.HealthClient, args);
  const statuses: Record<string, string> = {};
  for (const service of ["", "epd.v1.GatewayService"]) {
    statuses[service] = await new Promise<string>((resolve, reject) =>
      healthClient.check({ service }, new grpc.Metadata(), { deadline: deadlineIn(10_000) }, (error, response) =>
        error ? reject(error) : resolve(health.healthCheckResponse_ServingStatusToJSON(response.status)),
      ),
    );
  }
  healthClient.close();
  print({ services: listed.sort(), health: statuses });
  return listed.includes("epd.v1.GatewayService") && Object.values(statuses).every((s) => s === "SERVING");
}

function print(value: object): void {
  process.stdout.write(JSON.stringify(value) + "\n");
}

const COMMANDS: Record<string, (args: Args) => Promise<boolean>> = { generate, "bad-request": badRequest, abort, deadline, services };

async function main(): Promise<number> {
  const { command, args } = parseArgs(process.argv.slice(2));
  const run = COMMANDS[command];
  if (run === undefined) {
    process.stderr.write(`usage: main.js {${Object.keys(COMMANDS).join("|")}} --address HOST:PORT [...]\n`);
    return 2;
  }
  return (await run(args)) ? 0 : 1;
}

main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(`${error instanceof Error ? error.stack : String(error)}\n`);
    process.exit(2);
  },
);
