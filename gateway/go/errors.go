package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// violation is one bad field, addressed like messages[0].parts[1].image.data.
type violation struct {
	field       string
	description string
}

// requestError is every failure the gateway reports: a gRPC code, a message, the bad fields
// (INVALID_ARGUMENT) and, for a stage instance that could not serve a call, the instances the
// request's next attempt avoids. The servicer turns it into the rich status, in one place.
type requestError struct {
	code       codes.Code
	message    string
	violations []violation
	// stage, suspects: set when an instance of a stage could not serve (it is down, draining,
	// unreachable, or a peer it needed was): the request may be retried elsewhere before its
	// first token.
	stage    string
	suspects []string
}

func (e *requestError) Error() string { return e.message }

func (e *requestError) stageFailed() bool { return e.stage != "" }

func newError(code codes.Code, format string, args ...interface{}) *requestError {
	return &requestError{code: code, message: fmt.Sprintf(format, args...)}
}

func invalidArgument(prefix string, violations []violation) *requestError {
	return &requestError{code: codes.InvalidArgument, message: prefix + joinViolations(violations), violations: violations}
}

func fieldError(field, description string) *requestError {
	return &requestError{code: codes.InvalidArgument, message: field + ": " + description, violations: []violation{{field, description}}}
}

func joinViolations(violations []violation) string {
	texts := make([]string, len(violations))
	for i, v := range violations {
		texts[i] = v.field + " " + v.description
	}
	return strings.Join(texts, "; ")
}

// retryDelayOnExhaustion is what a RESOURCE_EXHAUSTED reply tells clients to wait, as the stages do.
const retryDelayOnExhaustion = time.Second

// status is the error as the client sees it: BadRequest details for bad fields, RetryInfo
// for RESOURCE_EXHAUSTED.
func (e *requestError) status() *status.Status {
	s := status.New(e.code, e.message)
	if len(e.violations) > 0 {
		detail := &errdetails.BadRequest{}
		for _, v := range e.violations {
			detail.FieldViolations = append(detail.FieldViolations, &errdetails.BadRequest_FieldViolation{Field: v.field, Description: v.description})
		}
		if withDetails, err := s.WithDetails(detail); err == nil {
			s = withDetails
		}
	}
	if e.code == codes.ResourceExhausted {
		if withDetails, err := s.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retryDelayOnExhaustion)}); err == nil {
			s = withDetails
		}
	}
	return s
}

// deadlineSlack: a stage's server and the gateway both time the same deadline; the server may
// cancel the stream (seen here as CANCELLED) a little before the gateway's own timer fires.
const deadlineSlack = 250 * time.Millisecond

// fromStageError is the error for a failed stage call. Client mistakes keep their code and
// fields, so the caller sees exactly what the stage refused; a stage that cannot be reached or
// failed in passing is UNAVAILABLE, and the instance is ejected and named a suspect (the
// request may be retried elsewhere); a call cancelled as the request's deadline ran out is
// DEADLINE_EXCEEDED, which no retry could fix; INTERNAL (a stage's bug) is not retried.
func fromStageError(ctx context.Context, p *pool, address string, err error) *requestError {
	s := status.Convert(err)
	peer := p.stage + " " + address
	message := peer + ": " + s.Message()
	deadline, hasDeadline := ctx.Deadline()
	switch code := s.Code(); {
	case code == codes.Canceled && hasDeadline && time.Until(deadline) < deadlineSlack:
		return newError(codes.DeadlineExceeded, "%s (the request's deadline ran out)", message)
	case code == codes.Canceled && ctx.Err() != nil:
		return newError(codes.Canceled, "%s", message) // the client went away or aborted
	case code == codes.InvalidArgument:
		e := &requestError{code: code, message: message}
		for _, detail := range s.Details() {
			if bad, ok := detail.(*errdetails.BadRequest); ok {
				for _, v := range bad.GetFieldViolations() {
					e.violations = append(e.violations, violation{v.GetField(), v.GetDescription()})
				}
			}
		}
		return e
	case code == codes.ResourceExhausted, code == codes.FailedPrecondition, code == codes.Aborted,
		code == codes.Unimplemented, code == codes.DeadlineExceeded, code == codes.Internal:
		return &requestError{code: code, message: message}
	default:
		reason := s.Message()
		if reason == "" {
			reason = "UNAVAILABLE"
		}
		p.eject(address, reason)
		return &requestError{code: codes.Unavailable, message: message, stage: p.stage, suspects: []string{address}}
	}
}

// remapItemFields rewrites an encoder's items[i].x field paths into the public request's paths.
func remapItemFields(e *requestError, paths []string) *requestError {
	if e.code != codes.InvalidArgument {
		return e
	}
	remapped := make([]violation, 0, len(e.violations))
	for _, v := range e.violations {
		field := v.field
		if field == "items" {
			field = "messages" // the whole item list: the chat
		}
		for index, path := range paths {
			prefix := fmt.Sprintf("items[%d]", index)
			if field == prefix || strings.HasPrefix(field, prefix+".") || strings.HasPrefix(field, prefix+"[") {
				field = path + field[len(prefix):]
				break
			}
		}
		remapped = append(remapped, violation{field, v.description})
	}
	message := joinViolations(remapped)
	if message == "" {
		message = e.message
	}
	return &requestError{code: codes.InvalidArgument, message: "invalid media: " + message, violations: remapped}
}

// enginePromptError turns an engine stage's error about the prompt into the public request's:
// prompt.chat paths become messages (the gateway sends the chat turn for turn, part for part).
// A stage from before the engines rendered chats refuses one as a prompt without token ids: no
// fault of the client's, so the instance is ejected and the request retried elsewhere (stages
// must be upgraded before gateways).
func enginePromptError(p *pool, address string, e *requestError) *requestError {
	if e.code != codes.InvalidArgument {
		return e
	}
	if len(e.violations) == 1 && e.violations[0].field == "prompt.token_ids" {
		p.eject(address, "it cannot render chats (epd.v1.EnginePrompt.chat): older than this gateway")
		return &requestError{
			code:    codes.Unavailable,
			message: fmt.Sprintf("%s %s predates chat prompts and refused one; upgrade stages before gateways", p.stage, address),
			stage:   p.stage, suspects: []string{address},
		}
	}
	touched := false
	remapped := make([]violation, len(e.violations))
	for i, v := range e.violations {
		remapped[i] = v
		if strings.HasPrefix(v.field, "prompt.chat") {
			remapped[i].field = "messages" + v.field[len("prompt.chat"):]
			touched = true
		}
	}
	if !touched {
		return e
	}
	return &requestError{code: codes.InvalidArgument, message: joinViolations(remapped), violations: remapped}
}

// codeNames are gRPC's canonical code names, as the Python services label their metrics.
var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN", codes.InvalidArgument: "INVALID_ARGUMENT",
	codes.DeadlineExceeded: "DEADLINE_EXCEEDED", codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED", codes.OutOfRange: "OUT_OF_RANGE",
	codes.Unimplemented: "UNIMPLEMENTED", codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE",
	codes.DataLoss: "DATA_LOSS", codes.Unauthenticated: "UNAUTHENTICATED",
}
